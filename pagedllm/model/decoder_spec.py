"""What sets one Llama-like architecture apart from Llama (``DecoderSpec``): each architecture's file
(qwen3.py, gemma.py, ...) reads it from its config, and llama.py builds the decoder by it."""

from dataclasses import dataclass

from pagedllm.model.layers.norm import RMSNorm


@dataclass(frozen=True)
class DecoderSpec:
    """What sets one Llama-like architecture apart, read from its config by the architecture's file
    (qwen3.py, gemma.py, ...): every field's default is Llama's."""

    qkv_bias: bool = False
    """q/k/v projections have a bias (Qwen2; Llama's ``attention_bias``)."""
    o_bias: bool = False
    """The output projection has a bias (Llama's ``attention_bias``)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key, before rotary (Qwen3, Gemma 3)."""
    norm: type[RMSNorm] = RMSNorm
    """Every norm's class (GemmaRMSNorm scales by 1 + w)."""
    sandwich_norms: bool = False
    """Gemma 2/3: a norm after attention, and norms before and after the MLP."""
    activation: str = "silu"
    """The gated MLP's activation (layers/activation.py ``gated_activation``)."""
    embed_scale: float | None = None
    """Embeddings multiplied by this (Gemma: sqrt(hidden_size)); None = 1."""
    query_scale: float | None = None
    """Softmax scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_softcap: float | None = None
    """Attention scores soft-capped at this (Gemma 2)."""
    final_softcap: float | None = None
    """Logits soft-capped at this (Gemma 2)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer, "sliding_attention" or "full_attention"; None = every layer as ``sliding_window`` says."""
    sliding_window: int | None = None
    """Keys a windowed layer's query sees, itself included; None = full attention everywhere."""
    rope_per_layer_type: bool = False
    """Rotary parameters differ by layer type (Gemma 3's local and global bases)."""

    def window_of(self, layer_idx: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.layer_types is None:  # Mistral: every layer
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def rope_key_of(self, layer_idx: int) -> str | None:
        return self.layer_types[layer_idx] if self.rope_per_layer_type else None
