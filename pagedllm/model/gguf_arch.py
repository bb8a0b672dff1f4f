"""What each GGUF architecture means in Hugging Face terms: its config, and the HF name of each tensor.

Tensor names come from the ``gguf`` package's own tables (``MODEL_TENSORS[arch]`` lists what
llama.cpp reads for an architecture, ``TENSOR_NAMES`` how each is spelled), so a name means here
what it means to llama.cpp; only the HF side is written down. Read:

- ``llama`` (also Mistral; Mixtral when ``llama.expert_count`` is set), ``qwen3``, ``qwen3moe``,
  ``gemma2``, ``gemma3`` (text), ``phi3``; and ``bert``, an encoder (embedding models such as bge,
  e5 or MiniLM, as llama.cpp's converter writes them), read as transformers' ``BertModel``.
- Experts are stacked in one tensor per projection, ``ffn_{gate,up,down}_exps`` [experts, ...],
  and come out as the per-expert tensors of the HF checkpoints (Qwen3-MoE's ``mlp.experts.E.*``,
  Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2``; quantized ones stay quantized, one
  ``QuantTensor`` per expert: ``gguf_loader.iter_gguf_tensors``); ``ffn_gate_inp`` is the router.
- Hyperparameters llama.cpp does not store but hard-codes per architecture are taken as
  llama.cpp takes them (cited where used): Gemma's local/global layer pattern, Gemma 3's local
  rotary base, Gemma's query scale, Qwen3-MoE's renormalised top-k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR as T, MODEL_TENSORS, TENSOR_NAMES

from pagedllm.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_ARCHES = (MODEL_ARCH.LLAMA, MODEL_ARCH.QWEN3, MODEL_ARCH.QWEN3MOE, MODEL_ARCH.GEMMA2, MODEL_ARCH.GEMMA3,
           MODEL_ARCH.PHI3, MODEL_ARCH.BERT)
SUPPORTED_ARCHITECTURES = tuple(MODEL_ARCH_NAMES[a] for a in _ARCHES)
ENCODER_ARCHITECTURES = ("bert",)
"""Bidirectional encoders: no rotary, no output norm; their layers are BERT's (``_BERT_LAYER``)."""

_GLOBAL = {T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head"}
_LAYER = {
    T.ATTN_NORM: "input_layernorm",
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_K: "self_attn.k_proj",
    T.ATTN_V: "self_attn.v_proj",
    T.ATTN_QKV: "self_attn.qkv_proj",  # phi3's fused q, k, v rows
    T.ATTN_OUT: "self_attn.o_proj",
    T.ATTN_Q_NORM: "self_attn.q_norm",
    T.ATTN_K_NORM: "self_attn.k_norm",
    T.ATTN_POST_NORM: "post_attention_layernorm",  # Gemma: after attention, before the residual add
    T.FFN_NORM: "post_attention_layernorm",  # Llama: before the MLP
    T.FFN_PRE_NORM: "pre_feedforward_layernorm",  # Gemma's (same GGUF spelling as FFN_NORM)
    T.FFN_POST_NORM: "post_feedforward_layernorm",
    T.FFN_GATE: "mlp.gate_proj",
    T.FFN_UP: "mlp.up_proj",
    T.FFN_DOWN: "mlp.down_proj",
    T.FFN_GATE_INP: "mlp.gate",
}
_BERT_GLOBAL = {
    T.TOKEN_EMBD: "embeddings.word_embeddings",
    T.POS_EMBD: "embeddings.position_embeddings",
    T.TOKEN_TYPES: "embeddings.token_type_embeddings",
    T.TOKEN_EMBD_NORM: "embeddings.LayerNorm",
}
_BERT_LAYER = {
    T.ATTN_Q: "attention.self.query",
    T.ATTN_K: "attention.self.key",
    T.ATTN_V: "attention.self.value",
    T.ATTN_OUT: "attention.output.dense",
    T.ATTN_OUT_NORM: "attention.output.LayerNorm",  # post-norm: after the residual add
    T.FFN_UP: "intermediate.dense",
    T.FFN_DOWN: "output.dense",
    T.LAYER_OUT_NORM: "output.LayerNorm",
}
EXPERT_TENSORS = {T.FFN_GATE_EXP: "gate_proj", T.FFN_UP_EXP: "up_proj", T.FFN_DOWN_EXP: "down_proj"}
_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Config, not weights: phi3's longrope factors, and llama's rope_freqs (Llama 3.1+: the divisor of each rotary
# frequency that llama.cpp's converter computes from the checkpoint's "llama3" rope scaling).
ROPE_FACTOR_TENSORS = (T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT, T.ROPE_FREQS)


def _name_table(arch: MODEL_ARCH) -> dict[str, T]:
    """GGUF base name ('token_embd', 'blk.{bid}.attn_q') -> tensor kind, for the kinds llama.cpp
    reads for ``arch`` (Gemma's FFN_PRE_NORM and Llama's FFN_NORM share one spelling). A BERT file's
    classifier head (``cls``, a reranker's) and fused ``attn_qkv`` are not among them."""
    if MODEL_ARCH_NAMES[arch] in ENCODER_ARCHITECTURES:
        known = set(_BERT_GLOBAL) | set(_BERT_LAYER)
    else:
        known = set(_GLOBAL) | set(_LAYER) | set(EXPERT_TENSORS) | set(ROPE_FACTOR_TENSORS)
    return {TENSOR_NAMES[kind]: kind for kind in MODEL_TENSORS[arch] if kind in known}


_TABLES = {MODEL_ARCH_NAMES[a]: _name_table(a) for a in _ARCHES}


def classify(arch: str, gguf_name: str) -> tuple[T, int | None, str]:
    """``blk.3.attn_q.weight`` -> (ATTN_Q, 3, 'weight'); ModelLoadError for a tensor ``arch`` lacks."""
    base, _, suffix = gguf_name.rpartition(".")
    layer = None
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, base = int(parts[1]), f"blk.{{bid}}.{parts[2]}"
    kind = _TABLES[arch].get(base)
    if kind is None or suffix not in ("weight", "bias"):
        raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r} for architecture {arch!r} "
                             "(e.g. per-expert ffn_*.E tensors are not supported)")
    return kind, layer, suffix


def hf_name(config: PretrainedConfig, kind: T, layer: int | None, suffix: str) -> str:
    """The HF checkpoint name; for a stacked expert tensor a template with ``{expert}``."""
    if config.model_type == "bert":
        if layer is None:
            return f"{_BERT_GLOBAL[kind]}.{suffix}"
        return f"encoder.layer.{layer}.{_BERT_LAYER[kind]}.{suffix}"
    if kind in _GLOBAL:
        return f"{_GLOBAL[kind]}.{suffix}"
    prefix = f"model.layers.{layer}"
    mixtral = config.model_type == "mixtral"
    if kind in EXPERT_TENSORS:
        proj = EXPERT_TENSORS[kind]
        if mixtral:
            return f"{prefix}.block_sparse_moe.experts.{{expert}}.{_MIXTRAL_EXPERT[proj]}.{suffix}"
        return f"{prefix}.mlp.experts.{{expert}}.{proj}.{suffix}"
    if kind == T.FFN_GATE_INP and mixtral:
        return f"{prefix}.block_sparse_moe.gate.{suffix}"
    if kind == T.FFN_UP and config.model_type == "phi3":
        return f"{prefix}.mlp.gate_up_proj.{suffix}"  # phi3's ffn_up holds gate rows, then up rows
    return f"{prefix}.{_LAYER[kind]}.{suffix}"


def hf_config(arch: str, meta, common: dict, tensor_shapes: dict[str, tuple[int, ...]],
              rope_factors: dict) -> PretrainedConfig:
    """The HF config of a GGUF ``arch``: ``common`` holds the Llama-like fields already read, ``meta(key,
    default)`` reads ``{arch}.{key}`` (ModelLoadError when missing and no default), ``tensor_shapes`` each
    tensor's GGUF shape by name, ``rope_factors`` the rope factor tensors by kind (phi3's long and short,
    llama's rope_freqs)."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    tensor_names = tensor_shapes.keys()
    if arch == "bert":
        return _bert_config(meta, common, tensor_shapes)

    num_layers = common["num_hidden_layers"]
    if arch == "llama" and T.ROPE_FREQS in rope_factors:  # divides each rotary frequency (layers/rotary.py)
        common = dict(common, rope_freq_factors=rope_factors[T.ROPE_FREQS])
    if arch == "llama" and int(meta("expert_count", 0)) > 0:
        return MixtralConfig(**common, architectures=["MixtralForCausalLM"],
                             num_local_experts=int(meta("expert_count")),
                             num_experts_per_tok=int(meta("expert_used_count")),
                             sliding_window=_window(meta))
    if arch == "llama":
        return LlamaConfig(**common, architectures=["LlamaForCausalLM"],
                           attention_bias="blk.0.attn_q.bias" in tensor_names)
    if arch == "qwen3":
        return Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    if arch == "qwen3moe":
        # llama.cpp's qwen3moe graph renormalises the top-k weights unless the file says otherwise.
        dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
        return Qwen3MoeConfig(**{**common, "intermediate_size": int(meta("feed_forward_length", 0)) or
                                 int(meta("expert_feed_forward_length"))},
                              architectures=["Qwen3MoeForCausalLM"],
                              num_experts=int(meta("expert_count")),
                              num_experts_per_tok=int(meta("expert_used_count")),
                              moe_intermediate_size=int(meta("expert_feed_forward_length")),
                              norm_topk_prob=bool(meta("expert_weights_norm", True)),
                              decoder_sparse_step=1, mlp_only_layers=dense)
    if arch in ("gemma2", "gemma3"):
        return _gemma_config(arch, meta, common)
    if arch == "phi3":
        return _phi3_config(meta, common, rope_factors)
    raise AssertionError(arch)


def _bert_config(meta, common: dict, tensor_shapes: dict[str, tuple[int, ...]]) -> PretrainedConfig:
    """transformers' BertModel config. GELU is the erf form BERT checkpoints declare (llama.cpp computes a
    tanh approximation of it); token types: the rows of ``token_types`` (one when the file has none)."""
    from transformers import BertConfig

    types = tensor_shapes.get("token_types.weight")
    return BertConfig(vocab_size=common["vocab_size"], hidden_size=common["hidden_size"],
                      num_hidden_layers=common["num_hidden_layers"],
                      num_attention_heads=common["num_attention_heads"],
                      intermediate_size=common["intermediate_size"],
                      max_position_embeddings=common["max_position_embeddings"],
                      layer_norm_eps=float(meta("attention.layer_norm_epsilon")),
                      type_vocab_size=1 if types is None else int(types[-1]), hidden_act="gelu",
                      pad_token_id=None, architectures=["BertModel"], dtype="float32")


def _window(meta) -> int | None:
    window = int(meta("attention.sliding_window", 0))
    return window or None


def _gemma_config(arch: str, meta, common: dict) -> PretrainedConfig:
    from transformers import Gemma2Config, Gemma3TextConfig

    num_layers, head_dim = common["num_hidden_layers"], common["head_dim"]
    window = _window(meta)
    # llama.cpp (llama_load_hparams_gemma2/3): local layers are those with il % n < n - 1, n = 2
    # for Gemma 2 and 6 for Gemma 3, unless the file carries the pattern; no window: all global.
    pattern = meta("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if window is None:
        local = [False] * num_layers
    elif isinstance(pattern, list):
        local = [bool(x) for x in pattern]
    else:
        local = [i % int(pattern) < int(pattern) - 1 for i in range(num_layers)]
    layer_types = ["sliding_attention" if is_local else "full_attention" for is_local in local]
    # Not stored: llama.cpp scales queries by head_dim ** -0.5, except the 27B models (46 / 62
    # layers) by (hidden / heads) ** -0.5, as Google's configs (query_pre_attn_scalar) do.
    big = num_layers == (46 if arch == "gemma2" else 62)
    query_scalar = common["hidden_size"] // common["num_attention_heads"] if big else head_dim
    fields = dict(common, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=query_scalar,
                  sliding_window=window, layer_types=layer_types,
                  final_logit_softcapping=meta("final_logit_softcapping", None) or None)
    if arch == "gemma2":
        return Gemma2Config(**fields, architectures=["Gemma2ForCausalLM"],
                            attn_logit_softcapping=meta("attn_logit_softcapping", None) or None)
    # Gemma 3: rope.freq_base and any scaling are the global layers'; local layers use
    # rope.freq_base_swa, which llama.cpp defaults to 10000 unscaled.
    full = dict(common["rope_parameters"])
    fields["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", 10000.0))},
    }
    return Gemma3TextConfig(**fields, architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=None)


def _phi3_config(meta, common: dict, rope_factors: dict) -> PretrainedConfig:
    from transformers import Phi3Config

    head_dim = common["head_dim"]
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"phi3 GGUF with partial rotary ({rope_dims} of {head_dim} dims per head) "
                             "is not supported")
    rope = dict(common["rope_parameters"])
    long, short = rope_factors.get(T.ROPE_FACTORS_LONG), rope_factors.get(T.ROPE_FACTORS_SHORT)
    if (long is None) != (short is None):
        raise ModelLoadError("phi3 GGUF has one of rope_factors_long / rope_factors_short but not both")
    if long is not None:
        if rope["rope_type"] != "default":
            raise ModelLoadError(f"phi3 GGUF with both rope factors and {rope['rope_type']} scaling")
        if len(long) != len(short) or len(long) != head_dim // 2:
            raise ModelLoadError(f"phi3 rope factors must have {head_dim // 2} entries, "
                                 f"got {len(long)} and {len(short)}")
        original = int(meta("rope.scaling.original_context_length"))
        rope = {"rope_type": "longrope", "rope_theta": rope["rope_theta"], "short_factor": short,
                "long_factor": long, "original_max_position_embeddings": original}
        attn_factor = meta("rope.scaling.attn_factor", None)
        if attn_factor is not None and not _is_default_longrope_factor(attn_factor, common, original):
            rope["attention_factor"] = float(attn_factor)
    fields = dict(common, rope_parameters=rope)
    return Phi3Config(**fields, architectures=["Phi3ForCausalLM"], hidden_act="silu",
                      sliding_window=_window(meta), pad_token_id=None,
                      original_max_position_embeddings=int(meta("rope.scaling.original_context_length",
                                                                common["max_position_embeddings"])))


def _is_default_longrope_factor(value: float, common: dict, original: int) -> bool:
    """True when ``value`` is what HF derives itself (sqrt(1 + ln(scale) / ln(original))), so the
    config leaves it out and HF computes it in full precision rather than from the stored float32."""
    import math

    scale = common["max_position_embeddings"] / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    return abs(value - default) <= 1e-6 * default
