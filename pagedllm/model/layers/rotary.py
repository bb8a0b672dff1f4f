"""Rotary position embedding (non-interleaved "rotate half" form used by HF Llama checkpoints).

Inverse frequencies and the attention scaling come from transformers' ``ROPE_INIT_FUNCTIONS``
(linear, llama3, yarn, longrope, ...); plain RoPE is ``1 / theta ** (2i / dim)``. cos/sin are
precomputed for ``max_position_embeddings`` positions in float32.

``dynamic`` (NTK) scaling changes frequencies with the running sequence length, which differs per
sequence in a batch; we use its frequencies at the original context length, which equal HF's
for sequences that fit in ``max_position_embeddings``.

``longrope`` (Phi-3): HF switches a whole forward pass to the long factors once its largest position
reaches ``original_max_position_embeddings``, which would re-rotate keys already cached. Here each
position keeps one rotation: the short factors below that length, the long ones from it on (equal
to HF for every sequence shorter than it).

Per-layer-type parameters (Gemma 3: ``rope_parameters = {"sliding_attention": {...},
"full_attention": {...}}``) are chosen with ``layer_type``.
"""

import torch
from torch import nn

from pagedllm.model.layers import cpu_fused


def rope_parameters(config, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None:
        params = params[layer_type]
    if params is None:  # older transformers: rope_theta + rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(config, head_dim: int, layer_type: str | None = None,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling) for ``config``; a GGUF's ``rope_freq_factors``
    (llama's rope_freqs tensor) divide the frequencies, as llama.cpp applies them."""
    inv_freq, scaling = _rope_inv_freq(config, head_dim, layer_type, seq_len)
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        if len(factors) != inv_freq.shape[0]:
            raise ValueError(f"rope_freq_factors has {len(factors)} entries for {inv_freq.shape[0]} rotary frequencies")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, scaling


def _rope_inv_freq(config, head_dim: int, layer_type: str | None, seq_len: int | None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # here: plain RoPE needs no transformers

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    if hasattr(config, "to_transformers"):  # a ResolvedConfig (model/resolved_config.py): they call its methods
        config = config.to_transformers()
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device=torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, layer_type: str | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = compute_inv_freq(config, head_dim, layer_type)
        max_positions = config.max_position_embeddings
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)  # [P, D/2]
        params = rope_parameters(config, layer_type)
        if params["rope_type"] == "longrope":  # long factors from the original length on (module docstring)
            original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
            if original < max_positions:
                long_inv_freq, _ = compute_inv_freq(config, head_dim, layer_type, seq_len=original + 1)
                freqs[original:] = torch.outer(torch.arange(original, max_positions, dtype=torch.float),
                                               long_inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        # sin with its first half negated (see cos_sin), precomputed: negation is exact, and it
        # saves cos_sin four ATen calls a step. The plain sin table is not kept (``sin_cache``).
        signed_sin = emb.sin() * scaling
        signed_sin[:, : head_dim // 2].neg_()
        self.register_buffer("signed_sin_cache", signed_sin, persistent=False)

    @property
    def sin_cache(self) -> torch.Tensor:
        """sin of every position [P, D], from the signed table (exact: negation)."""
        sin = self.signed_sin_cache.clone()
        sin[:, : self.head_dim // 2].neg_()
        return sin

    def limit_positions(self, num_positions: int) -> None:
        """Keep the tables' first ``num_positions`` rows: the engine serves up to max_model_len tokens, and a
        model's context length may be far longer (Gemma 3 1B: 32768 positions x 256 dims, two tables of each)."""
        if num_positions < self.cos_cache.shape[0]:
            self.cos_cache = self.cos_cache[:num_positions].clone()
            self.signed_sin_cache = self.signed_sin_cache[:num_positions].clone()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [T, 1, D] in ``dtype``: gather them once per step and hand them to
        every layer's ``rotate`` (per layer, the gathers and casts were most of rotary's time at decode).

        The signed sin is ``sin`` with its first half negated, so that ``rotate_half(x) * sin``, i.e.
        ``cat(-x2, x1) * sin``, becomes ``roll(x, D/2) * signed_sin``: the same products (negation is
        exact), one call instead of three."""
        # index_select, not cache[positions]: the same rows without advanced indexing's overhead
        # (~8 us a call at decode).
        cos = torch.index_select(self.cos_cache, 0, positions).unsqueeze(1).to(dtype)
        return cos, torch.index_select(self.signed_sin_cache, 0, positions).unsqueeze(1).to(dtype)

    def rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` [T, heads, D] by ``cos_sin`` from ``cos_sin()``: ``x * cos + rotate_half(x) * sin``
        as HF computes it. The heads may be queries and keys side by side (one pass instead of two)."""
        cos, signed_sin = cos_sin
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * signed_sin

    def rotate_qkv(
        self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused projection ``qkv`` [T, (H + 2*Hkv) * D] into rotated queries [T, H, D], rotated
        keys [T, Hkv, D] and values [T, Hkv, D]. On CPU float32 with the compiled library the rotation
        is one call, in place on ``qkv`` (the caller's fresh projection output; the results are views
        of it), with the reference's values bit for bit; elsewhere it is ``rotate``."""
        num_tokens, D = qkv.shape[0], self.head_dim
        ops = cpu_fused.usable(qkv)
        if ops is not None and qkv.dim() == 2 and qkv.is_contiguous() and cos_sin[0].dtype == torch.float32:
            ops.rotary_qk(qkv, cos_sin[0], cos_sin[1], num_heads + num_kv_heads, D)
            # split_with_sizes: the same views as Tensor.split, without its Python wrapper (~3 us a layer)
            return qkv.view(num_tokens, -1, D).split_with_sizes([num_heads, num_kv_heads, num_kv_heads], dim=1)
        qk, v = qkv.split([(num_heads + num_kv_heads) * D, num_kv_heads * D], dim=-1)
        # Queries and keys rotate together, [T, H + Hkv, D]: half the elementwise calls of two passes.
        qk = self.rotate(qk.view(num_tokens, -1, D), cos_sin)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        return q, k, v.view(num_tokens, -1, D)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin(positions, query.dtype)
        return self.rotate(query, cos_sin), self.rotate(key, cos_sin)


def limit_rotary_positions(model: nn.Module, num_positions: int) -> None:
    """``limit_positions`` on every rotary table of ``model``."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.limit_positions(num_positions)
