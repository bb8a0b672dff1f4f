"""GGUF (llama.cpp) checkpoints -> a Hugging Face directory (config.json, float32 safetensors, tokenizer).

The ``llama`` and ``qwen3`` GGUF architectures are read (qwen3: Llama tensors plus per-head q/k
norms; rotate-half rope in llama.cpp too, so its Q/K rows are not permuted). Tensors are
dequantized with ``gguf.quants`` and renamed to Hugging Face names. llama.cpp's converter permutes the rows of Q and K (and their
biases) so that each head's rotary pairs are interleaved::

    HF rows of one head:    [x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)]   (rotate-half pairs xi, yi)
    GGUF rows of one head:  [x0 y0 x1 y1 ... ]                          (adjacent pairs)

``_unpermute`` restores the HF order. ``convert_gguf_to_hf_dir`` writes into a directory the
caller chose; ``loader.py`` makes that atomic and cached.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, Qwen3Config

from pagedllm.errors import ModelLoadError
from pagedllm.model.layers import quantized
from pagedllm.model.layers.quantized import QuantTensor

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")
# GGUF architecture -> (HF config class, HF architecture name)
_HF_ARCHITECTURES = {"llama": (LlamaConfig, "LlamaForCausalLM"), "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ModelLoadError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r} (e.g. rope_freqs / llama3 rope is not supported)")


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (see module docstring); works for weights and biases."""
    shape = w.shape
    head_dim = shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _open(path: str | os.PathLike) -> GGUFReader:
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


def gguf_to_hf_config(reader: GGUFReader) -> LlamaConfig | Qwen3Config:
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

    def meta(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
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
    config_class, hf_architecture = _HF_ARCHITECTURES[arch]
    return config_class(
        architectures=[hf_architecture],
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
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        dtype="float32",
    )


def iter_gguf_tensors(reader: GGUFReader, config: LlamaConfig,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, float32 tensor) for every tensor, dequantized and with Q/K rows un-permuted.
    ``keep_quantized``: 2-D tensors of a type the quantized kernel reads (Q8_0, Q4_0, Q4_1) come
    as ``QuantTensor`` instead (rows un-permuted as they are, still quantized; the bytes are a
    view of the reader's memory map until a weight loader repacks them)."""
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"unsupported GGUF tensor type {qtype.name} (tensor {tensor.name!r}); supported: "
                + ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
            )
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if keep_quantized and len(shape) == 2 and int(qtype) in quantized.SUPPORTED:
            raw = np.asarray(tensor.data).reshape(shape[0], -1)  # [rows, row bytes], one row per output
            if name.endswith("q_proj.weight"):
                raw = _unpermute(raw, config.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                raw = _unpermute(raw, config.num_key_value_heads)
            yield name, QuantTensor(int(qtype), torch.from_numpy(np.array(raw, order="C")), shape[1])  # a copy: the map is read-only
            continue
        try:
            array = dequantize(tensor.data, qtype).reshape(shape)
        except Exception as e:
            raise ModelLoadError(f"corrupt GGUF tensor {tensor.name!r}: {e}") from e
        permuted = config.model_type == "llama"  # only llama's converter permutes Q/K
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute(array, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute(array, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write config.json, generation_config.json, model.safetensors (float32) and, when the GGUF
    carries one, the tokenizer (with its chat template) into ``out_dir`` (created if needed)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    config = gguf_to_hf_config(reader)
    tensors = dict(iter_gguf_tensors(reader, config))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(out_dir)
    if "tokenizer.ggml.model" in reader.fields:
        _convert_tokenizer(gguf_path, reader, out_dir)


def _convert_tokenizer(gguf_path: Path, reader: GGUFReader, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF {str(gguf_path)!r}: {e}") from e
    template = _field(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))


def describe(gguf_path: str | os.PathLike) -> dict:
    """Small summary (architecture, tensor types) for error messages and logs."""
    reader = _open(gguf_path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"architecture": _field(reader, "general.architecture"), "tensor_types": types}


__all__ = ["convert_gguf_to_hf_dir", "gguf_to_hf_config", "iter_gguf_tensors", "hf_tensor_name", "describe"]
