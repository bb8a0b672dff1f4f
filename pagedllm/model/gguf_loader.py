"""GGUF (llama.cpp) checkpoints -> a Hugging Face directory (config.json, float32 safetensors, tokenizer).

The architectures of ``gguf_arch.py`` are read (llama incl. Mixtral, qwen3, qwen3moe, gemma2,
gemma3, phi3; names and hyperparameters there). Tensors are dequantized with ``gguf.quants`` and
renamed to Hugging Face names. For ``llama`` only (whose llama.cpp rope rotates adjacent pairs),
the converter permutes the rows of Q and K (and their biases) so that each head's rotary pairs
are interleaved::

    HF rows of one head:    [x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)]   (rotate-half pairs xi, yi)
    GGUF rows of one head:  [x0 y0 x1 y1 ... ]                          (adjacent pairs)

``_unpermute`` restores the HF order. ``convert_gguf_to_hf_dir`` writes into a directory the
caller chose; ``loader.py`` makes that atomic and cached.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file

from typing import TYPE_CHECKING

from pagedllm.errors import ModelLoadError
from pagedllm.model import gguf_arch, gguf_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig
from pagedllm.model.gguf_arch import SUPPORTED_ARCHITECTURES
from pagedllm.model.gguf_model_checks import validate_gguf
from pagedllm.model.layers import quantized
from pagedllm.model.layers.quantized import QuantTensor

SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                 "IQ4_NL")
)


def hf_tensor_name(gguf_name: str, config: PretrainedConfig | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (``config``: the file's
    HF config, a Llama's if None); ModelLoadError if unknown. Stacked experts: a ``{expert}`` template."""
    if config is None:
        from transformers import LlamaConfig

        config = LlamaConfig()
    return gguf_arch.hf_name(config, *gguf_arch.classify(_gguf_arch(config), gguf_name))


def _gguf_arch(config: PretrainedConfig) -> str:
    return {"llama": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma2": "gemma2",
            "gemma3_text": "gemma3", "phi3": "phi3", "bert": "bert"}[config.model_type]


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (see module docstring); works for weights and biases."""
    shape = w.shape
    head_dim = shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _open(path: str | os.PathLike) -> GGUFReader:
    validate_gguf(path)
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on truncated or bad files
        raise ModelLoadError(f"corrupt or unreadable GGUF file {str(path)!r}: {e}") from e


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):  # stored as float32: 1e-5 reads back as 9.99999974e-06
        value = float(str(np.float32(value)))
    return value


_REQUIRED = object()


def gguf_to_hf_config(reader: GGUFReader) -> PretrainedConfig:
    """The HF config from the GGUF metadata; ModelLoadError for unsupported architectures."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")

    def meta(key: str, default=_REQUIRED):
        value = _field(reader, f"{arch}.{key}", None)
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
            return default
        return value

    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    rope_parameters: dict = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_parameters.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise ModelLoadError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: none, linear")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    common = dict(
        vocab_size=int(embedding.shape[1]),  # GGUF shapes list the fastest dimension first
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        dtype="float32",
    )
    rope_factors = {}
    for tensor in reader.tensors:
        kind = gguf_arch.classify(arch, tensor.name)[0]
        if kind in gguf_arch.ROPE_FACTOR_TENSORS:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
            rope_factors[kind] = [float(str(np.float32(x))) for x in values]  # as _field reads floats
    shapes = {t.name: tuple(int(d) for d in t.shape.tolist()) for t in reader.tensors}
    return gguf_arch.hf_config(arch, meta, common, shapes, rope_factors)


def iter_gguf_tensors(reader: GGUFReader, config: PretrainedConfig,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, float32 tensor) for every weight, dequantized, with Q/K rows un-permuted (llama),
    Gemma's norms back to HF's ``1 + w`` form, and stacked experts split per expert.
    ``keep_quantized``: 2-D tensors of a type the quantized kernel reads (``quantized.SUPPORTED``)
    come as ``QuantTensor`` instead (rows un-permuted as they are, phi3's fused q/k/v split by
    rows, still quantized), and so do stacked experts of those types, one ``QuantTensor`` per expert.
    Their bytes are read-only views of the reader's memory map, not copies (Q and K of llama,
    un-permuted, are copies): a weight loader repacks them and keeps nothing of them.

    Once the consumer asks for the next tensor, the map's pages of the one before are dropped from
    this process (``release_pages``): each page read while loading counts in the resident set until
    then, a whole file's worth by the last tensor. A view still held (gate waiting for up, q and k
    for v) reads its bytes again from the page cache when the weight is complete, so the pages of
    the few tensors before are dropped again too, and the whole map's at the end."""
    arch = _gguf_arch(config)
    permuted = arch == "llama"  # only llama's converter permutes Q/K
    tensors = list(reader.tensors)
    for i, tensor in enumerate(tensors):
        yield from _tensor_items(tensor, arch, permuted, config, keep_quantized)
        for before in tensors[max(0, i - _RELEASE_WINDOW) : i + 1]:
            release_pages(reader, before)
    release_pages(reader, None)


_RELEASE_WINDOW = 8
"""Tensors before the current one whose pages are dropped again: a fused weight's parts lie within a
few tensors of each other in the files llama.cpp's converters write (one layer's tensors together)."""


def _tensor_items(tensor, arch: str, permuted: bool, config: PretrainedConfig,
                  keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """``iter_gguf_tensors``'s items for one GGUF tensor."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"unsupported GGUF tensor type {qtype.name} (tensor {tensor.name!r}); supported: "
            + ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        )
    kind, layer, suffix = gguf_arch.classify(arch, tensor.name)
    if kind in gguf_arch.ROPE_FACTOR_TENSORS:  # read into the config
        return
    name = gguf_arch.hf_name(config, kind, layer, suffix)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if keep_quantized and len(shape) == 2 and int(qtype) in quantized.SUPPORTED:
        raw = np.asarray(tensor.data).reshape(shape[0], -1)  # [rows, row bytes], one row per output
        if permuted and name.endswith("q_proj.weight"):
            raw = _unpermute(raw, config.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            raw = _unpermute(raw, config.num_key_value_heads)
        for part_name, rows in _split_fused(config, name, _map_view(raw)):
            yield part_name, QuantTensor(int(qtype), rows, shape[1])
        return
    if keep_quantized and kind in gguf_arch.EXPERT_TENSORS and int(qtype) in quantized.SUPPORTED:
        raw = _map_view(np.asarray(tensor.data).reshape(shape[0], shape[1], -1))  # [experts, rows, row bytes]
        for expert in range(shape[0]):
            yield name.format(expert=expert), QuantTensor(int(qtype), raw[expert], shape[2])
        return
    try:
        array = dequantize(tensor.data, qtype).reshape(shape)
    except Exception as e:
        raise ModelLoadError(f"corrupt GGUF tensor {tensor.name!r}: {e}") from e
    if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
        array = _unpermute(array, config.num_attention_heads)
    elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
        array = _unpermute(array, config.num_key_value_heads)
    elif arch.startswith("gemma") and name.endswith("norm.weight"):
        array = array - np.float32(1.0)  # llama.cpp's converter stores Gemma's 1 + w
    if kind in gguf_arch.EXPERT_TENSORS:
        for expert in range(array.shape[0]):
            yield name.format(expert=expert), _tensor(array[expert])
    else:
        yield name, _tensor(array)


def _map_view(array: np.ndarray) -> torch.Tensor:
    """``array`` (possibly a read-only view of the file's map) as a uint8 tensor sharing its memory.
    Nothing writes to a ``QuantTensor``'s bytes, so torch's warning about a read-only array is moot."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def release_pages(reader: GGUFReader, tensor=None) -> None:
    """Drop the map's pages under ``tensor`` (None: the whole file) from this process's resident set
    (``MADV_DONTNEED`` on a read-only file map: the pages stay in the page cache, a later read maps
    them again). A no-op where the map or the call is not there."""
    mapping = getattr(reader.data, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED") or mapping.closed:
        return
    first, size = (0, len(mapping)) if tensor is None else (int(tensor.data_offset), int(tensor.n_bytes))
    start = first // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(first + size, len(mapping))
    if end <= start:
        return
    try:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # e.g. a closed map
        pass


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc only; elsewhere a no-op). Repacking
    leaves many freed 1-30 MB temporaries in glibc's heap, which it keeps: the default model's
    load measured 253 MB of resident growth before this, 155 MB after (the weights are ~100 MB)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


TRIM_EVERY_BYTES = 256 << 20
"""Source bytes loaded between two ``release_free_heap`` calls (``trimming_heap``)."""


def trimming_heap(weights: Iterator[tuple[str, torch.Tensor | QuantTensor]]):
    """``weights`` as they come, the heap's free pages handed back after every ``TRIM_EVERY_BYTES`` of them.
    Repacking a weight frees temporaries below the mmap threshold (worker/host_memory.py) into the heap,
    between weights that stay: holes it keeps resident. Trimmed only at the end, a 30B-A3B-shaped Q4_K_M
    file (17 GiB; 12288 experts repacked one by one) would have peaked ~60 MiB a layer above what it holds
    (measured: 0.57 GiB at 12 layers, 0.09 GiB at 4), 2.7 GiB at 48: more than a 24 GB machine has left."""
    since = 0
    for name, tensor in weights:
        yield name, tensor
        since += tensor.raw.numel() if isinstance(tensor, QuantTensor) else tensor.numel() * tensor.element_size()
        if since >= TRIM_EVERY_BYTES:
            release_free_heap()
            since = 0


class _WeightsReader(GGUFReader):
    """A GGUFReader that steps over the tokenizer's arrays (tokens, scores, merges) instead of parsing them: the
    reader makes a numpy view per element, ~5 s and ~100 MB for a 49 K vocabulary, and a load that reads its
    weights from the file takes the tokenizer from the converted directory."""

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            key_len, key = self._get_str(offs)
            value_offs = offs + int(key_len.nbytes + key.nbytes)
            value_type = int(self._get(value_offs, np.uint32)[0])
            if value_type == GGUFValueType.ARRAY and bytes(key).startswith(b"tokenizer."):
                offs = self._skip_array(value_offs + 4)
            else:
                offs = super()._build_fields(offs, 1)
        return offs

    def _skip_array(self, offs: int) -> int:
        """The offset after the array whose item type starts at ``offs``."""
        item_type = GGUFValueType(int(self._get(offs, np.uint32)[0]))
        length = int(self._get(offs + 4, np.uint64)[0])
        offs += 12
        if item_type == GGUFValueType.STRING:  # each a uint64 length, then its bytes
            data = self.data
            for _ in range(length):
                offs += 8 + int.from_bytes(data[offs:offs + 8].tobytes(), "little")
            return offs
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is None:
            raise ValueError(f"tokenizer array of {item_type.name} items")
        return offs + length * np.dtype(scalar).itemsize


def open_for_weights(path: str | os.PathLike) -> GGUFReader:
    """The reader of ``path`` for its weights and config: its tensors and every metadata field but the tokenizer's
    arrays (``_WeightsReader``), which only transformers' tokenizer converter reads. The file is validated first
    (``gguf_validate``): InvalidModelFileError, naming what is wrong, before any of it is trusted."""
    validate_gguf(path)
    try:
        return _WeightsReader(path)
    except Exception as e:  # as _open
        raise ModelLoadError(f"corrupt or unreadable GGUF file {str(path)!r}: {e}") from e


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))


def _split_fused(config: PretrainedConfig, name: str, rows: torch.Tensor):
    """phi3's fused q/k/v and gate/up rows as the separate tensors the model loads, so they stay
    quantized (the model splits fused float tensors itself, but would dequantize these)."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        yield from zip((name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")),
                       rows.split([q, kv, kv], dim=0))
    elif name.endswith("mlp.gate_up_proj.weight"):
        yield from zip((name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")), rows.chunk(2, dim=0))
    else:
        yield name, rows


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, weights: bool = True) -> None:
    """Write config.json, generation_config.json, model.safetensors (float32; only with ``weights``)
    and, when the GGUF carries one, the tokenizer (with its chat template) into ``out_dir`` (created
    if needed). Without ``weights`` the directory holds what a load that reads its weights from the
    GGUF itself needs: a 1 B model's float32 weights are 4 GB of disk and, while converting, of memory."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_for_weights(gguf_path)  # the tokenizer's arrays are read by transformers' converter below
    config = gguf_to_hf_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights:
        tensors = dict(iter_gguf_tensors(reader, config))
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        del tensors
    config.save_pretrained(out_dir)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(out_dir)
    if "tokenizer.ggml.model" in reader.fields:
        gguf_tokenizer.convert_tokenizer(gguf_path, lambda key, default=None: _field(reader, key, default), out_dir)


def describe(gguf_path: str | os.PathLike) -> dict:
    """Small summary (architecture, tensor types) for error messages and logs."""
    reader = _open(gguf_path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"architecture": _field(reader, "general.architecture"), "tensor_types": types}


__all__ = ["convert_gguf_to_hf_dir", "gguf_to_hf_config", "iter_gguf_tensors", "hf_tensor_name", "describe"]
