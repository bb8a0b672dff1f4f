"""Write tiny GGUF files from a Hugging Face Llama the way llama.cpp's converter does (incl. Q/K permutation)."""

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf does to Q/K rows: rotate-half pairs become adjacent rows."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def decoder_writer(cfg, path, arch: str, always_head_dim: bool) -> GGUFWriter:
    """A GGUFWriter for ``arch`` with a Llama-like decoder's hyperparameters from the HF ``cfg``; the
    head size is written when it is not hidden / heads, or always (``always_head_dim``)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if always_head_dim or cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    return writer


def write_llama_gguf(hf_model, path, qtype: GGMLQuantizationType, arch: str = "llama", override: dict | None = None):
    """Write ``hf_model`` as GGUF with 2-D weights in ``qtype`` (1-D norms stay F32).

    Returns the HF state dict as the file holds it (quantized then dequantized), for reference.
    ``override`` maps a GGUF tensor name to a (raw bytes array, raw qtype) to plant odd tensors.
    """
    cfg = hf_model.config
    writer = decoder_writer(cfg, path, arch, always_head_dim=False)
    reference = {}
    tied = cfg.tie_word_embeddings
    for name, tensor in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        target = gguf_name(name)
        if override and target in override:
            raw, raw_type = override[target]
            writer.add_tensor(target, raw, raw_dtype=raw_type)
            continue
        if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
            stored, held = array, array
        elif qtype == GGMLQuantizationType.F16:
            stored = array.astype(np.float16)
            held = stored.astype(np.float32)
        else:
            stored = quantize(array, qtype)
            held = dequantize(stored, qtype).reshape(array.shape)
        writer.add_tensor(target, stored, raw_dtype=None if stored.dtype != np.uint8 else qtype)
        if name.endswith("q_proj.weight"):  # reference in HF order: undo the permutation
            held = _inverse(held, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            held = _inverse(held, cfg.num_key_value_heads)
        reference[name] = torch.from_numpy(np.array(held, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tied:
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    return reference


def _inverse(w: np.ndarray, num_heads: int) -> np.ndarray:
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
