"""Gemma 2 and Gemma 3 (text): Llama-like decoders with

- (1 + w) RMSNorms, and "sandwich" norms: after attention, and before and after the MLP;
- embeddings scaled by sqrt(hidden_size); GeGLU MLP (tanh GELU);
- softmax scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- sliding-window layers alternating with global ones (``layer_types``);
- Gemma 2: attention scores and final logits soft-capped (``attn_logit_softcapping``,
  ``final_logit_softcapping``);
- Gemma 3: q/k RMSNorms (1 + w) before rotary, and separate rotary parameters for local and
  global layers (``rope_parameters`` keyed by layer type: base 10k local, 1M global).
"""

from pagedllm.model.layers.norm import GemmaRMSNorm
from pagedllm.model.llama import DecoderSpec, LlamaForCausalLM


def _gemma_spec(config, **extra) -> DecoderSpec:
    return DecoderSpec(
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        norm=GemmaRMSNorm,
        sandwich_norms=True,
        activation=config.hidden_activation,
        embed_scale=config.hidden_size**0.5,
        query_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        layer_types=tuple(config.layer_types),
        sliding_window=config.sliding_window,
        **extra,
    )


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config) -> DecoderSpec:
        return _gemma_spec(config)


class Gemma3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config) -> DecoderSpec:
        params = getattr(config, "rope_parameters", None) or {}
        per_type = "full_attention" in params or "sliding_attention" in params
        return _gemma_spec(config, qk_norm=True, rope_per_layer_type=per_type)
