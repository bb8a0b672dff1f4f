"""Write tiny GGUF files from Hugging Face models the way llama.cpp's converter (convert_hf_to_gguf.py)
does: Q/K permutation for llama, Gemma's norms stored as 1 + w, stacked experts, phi3's rope
factor tensors, and each architecture's hyperparameter keys."""

import gguf
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
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # gemma3: the global layers' base
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # Phi3: none
    if always_head_dim or head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    return writer


def write_llama_gguf(hf_model, path, qtype: GGMLQuantizationType, arch: str = "llama", override: dict | None = None,
                     extra: dict | None = None):
    """Write ``hf_model`` as GGUF with 2-D weights in ``qtype`` (1-D norms stay F32).

    Returns the HF state dict as the file holds it (quantized then dequantized), for reference.
    ``override`` maps a GGUF tensor name to a (raw bytes array, raw qtype) to plant odd tensors;
    ``extra`` adds float32 tensors the checkpoint lacks (name -> array), e.g. ``rope_freqs.weight``.
    """
    cfg = hf_model.config
    writer = decoder_writer(cfg, path, arch, always_head_dim=False)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
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
    if tied and "model.embed_tokens.weight" in reference:  # (an overridden embedding has no reference here)
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    return reference


def _inverse(w: np.ndarray, num_heads: int) -> np.ndarray:
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF model_type -> the GGUF architecture llama.cpp's converter writes it as
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


def write_converted_gguf(hf_model, path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                         vocab: list[str] | None = None, pooling_type: int | None = None) -> dict:
    """Write ``hf_model`` (any architecture in ``GGUF_ARCH``) as llama.cpp's converter would, with
    2-D and 3-D weights in ``qtype`` (norms and rope factors F32); ``vocab``: a sentencepiece
    vocabulary for the file (``spm_vocab``). Returns the HF state dict the file holds (quantized
    then dequantized, Gemma's norms ``(1 + w) - 1`` in float32), for reference."""
    cfg = hf_model.config
    arch = GGUF_ARCH[cfg.model_type]
    writer = decoder_writer(cfg, path, arch, always_head_dim=arch != "llama")
    _write_arch_keys(writer, cfg, arch)
    if pooling_type is not None:  # an embedder's: llama.cpp's `<arch>.pooling_type`
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    if vocab is not None:
        _write_spm_vocab(writer, vocab)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    reference = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' fused experts: gate rows, then up
            half = array.shape[1] // 2
            parts = [("gate_proj", array[:, :half]), ("up_proj", array[:, half:])]
            held = [_store(writer, names, name.replace("gate_up_proj", f"{p}.weight"), a, cfg, arch, qtype)
                    for p, a in parts]
            reference[name] = torch.from_numpy(np.concatenate(held, axis=1))
            continue
        if name.endswith("mlp.experts.down_proj"):
            name_in_map = name + ".weight"
        else:
            name_in_map = name
        reference[name] = torch.from_numpy(_store(writer, names, name_in_map, array, cfg, arch, qtype))
    if cfg.model_type == "phi3" and cfg.rope_parameters.get("rope_type") == "longrope":
        for kind, key in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
                          (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor")):
            writer.add_tensor(gguf.TENSOR_NAMES[kind] + ".weight",
                              np.asarray(cfg.rope_parameters[key], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if cfg.tie_word_embeddings:
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    return reference


def _store(writer, names, name: str, array: np.ndarray, cfg, arch: str, qtype) -> np.ndarray:
    """Add one tensor as the converter would; returns its value as the file holds it, in HF form."""
    target = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert target is not None, name
    gemma_norm = arch.startswith("gemma") and name.endswith("norm.weight")
    if gemma_norm:
        array = array + np.float32(1.0)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    proj = next((p for p in heads if f".{p}." in name), None)
    if arch == "llama" and proj is not None:
        array = llama_cpp_permute(array, heads[proj])
    if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) and (
            array.ndim == 1 or array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]):
        qtype = GGMLQuantizationType.F16  # rows not in whole blocks: the converter falls back to F16
    if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
        stored, held = array, array
    elif qtype == GGMLQuantizationType.F16:
        stored = array.astype(np.float16)
        held = stored.astype(np.float32)
    else:
        stored = quantize(array, qtype)
        held = dequantize(stored, qtype).reshape(array.shape)
    writer.add_tensor(target, stored, raw_dtype=None if stored.dtype != np.uint8 else qtype)
    if arch == "llama" and proj is not None:
        held = _inverse(held, heads[proj])
    if gemma_norm:
        held = held - np.float32(1.0)
    return np.array(held, dtype=np.float32)


def _write_arch_keys(writer: GGUFWriter, cfg, arch: str) -> None:
    """The hyperparameters each architecture's converter class adds to the common ones."""
    if cfg.model_type == "mixtral" or arch == "qwen3moe":
        writer.add_expert_count(cfg.num_local_experts if cfg.model_type == "mixtral" else cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        rope = cfg.rope_parameters
        original = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        writer.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / original
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_attn_factors(
                float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)


SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def spm_vocab(size: int, pieces: list[str]) -> list[str]:
    """A sentencepiece vocabulary of ``size``: pad/eos/bos/unk (ids 0-3), the 256 byte tokens, then
    ``pieces`` (highest scores first), then filler."""
    tokens = list(SPM_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    return tokens + [f"filler{i}" for i in range(size - len(tokens))]


def _write_spm_vocab(writer: GGUFWriter, tokens: list[str]) -> None:
    """As the converter's sentencepiece vocab (``llama`` tokenizer model): control, byte, normal types."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([float(-i) for i in range(len(tokens))])
    types = [gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.BYTE] * 256
    writer.add_token_types([int(t) for t in types] + [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(types)))
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)


def llama3_rope_freqs(cfg) -> np.ndarray:
    """The ``rope_freqs.weight`` llama.cpp's converter writes for a "llama3" rope scaling: per rotary frequency,
    1 below the high-frequency wavelength, ``factor`` above the low-frequency one, smoothly between."""
    rope = cfg.rope_parameters
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in inv_freq:
        wavelength = 2 * np.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_bert_gguf(model_dir, path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                    pooling_type: int | None = 1, lowercase: bool | None = True, drop: tuple[str, ...] = ()) -> None:
    """Write the BERT encoder saved in ``model_dir`` (weights and WordPiece tokenizer) as llama.cpp's
    converter does (its ``BertModel``): tensor names from gguf's own map, 2-D weights but the position
    and token-type tables in ``qtype``, the vocabulary in the converter's phantom-space form (U+2581
    before a word-initial piece, ``##`` dropped, control tokens as they are), its special token ids and
    ``tokenizer.ggml.normalizer.lowercase`` (left out when ``lowercase`` is None, as older converters
    did). ``drop``: GGUF tensor names left out."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    writer = GGUFWriter(str(path), "bert")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_causal_attention(False)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    by_id = {token_id: piece for piece, token_id in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    pieces, types = [], []
    for token_id in range(cfg.vocab_size):
        if token_id in special:
            pieces.append(by_id[token_id])
            types.append(gguf.TokenType.CONTROL)
        elif token_id not in by_id:  # a duplicate line of vocab.txt: the id no piece maps to
            pieces.append(f"\u2581[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            piece = by_id[token_id]
            pieces.append(piece[2:] if piece.startswith("##") else "\u2581" + piece)
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_type_count(cfg.type_vocab_size)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(pieces)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokenizer.cls_token_id)
    writer.add_eos_token_id(tokenizer.sep_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_sep_token_id(tokenizer.sep_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_mask_token_id(tokenizer.mask_token_id)
    if lowercase is not None:
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)  # (this gguf has no add_ for it)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg.num_hidden_layers)
    tables = ("position_embd.weight", "token_types.weight")
    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        name = name.removeprefix("bert.")
        if name.endswith("position_ids") or name.startswith("pooler."):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if target in drop:
            continue
        array = np.asarray(array, dtype=np.float32)
        if array.ndim == 2 and target not in tables and qtype != GGMLQuantizationType.F32:
            stored = quantize(array, qtype)
            writer.add_tensor(target, stored, raw_dtype=None if stored.dtype != np.uint8 else qtype)
        else:
            writer.add_tensor(target, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
