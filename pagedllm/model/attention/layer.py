"""``Attention``: the layer a model calls; it reads metadata and its KV cache from the forward context, and attends
through the backend ``set_attention_backend`` gave it (backend.py owns the backends' interface and knows no layer)."""

import torch
from torch import nn

from pagedllm.model import batch_invariant
from pagedllm.model.attention import cpu_op
from pagedllm.model.attention.backend import TORCH_BACKEND, AttentionBackend
from pagedllm.model.attention.paged import causal_attention_no_cache
from pagedllm.model.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention for one layer: write this step's K/V, then attend through block tables."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # keys a query sees, itself included; None = all (paged.py)
        self.softcap = softcap  # attention scores -> softcap * tanh(scores / softcap); None = off
        # Set for the whole model by ``set_attention_backend`` (the model runner does it).
        self.backend: AttentionBackend = TORCH_BACKEND
        self.batch_invariant = batch_invariant.chosen()  # needs a backend in the mode (set_attention_backend)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ctx = get_forward_context()
        metadata = ctx.attn_metadata if ctx is not None else None
        if ctx is None or ctx.kv_caches is None or metadata is None:
            # No cache (profiling / dummy run): attend over the current tokens only.
            starts = metadata.query_start_loc if metadata is not None else None
            return causal_attention_no_cache(query, key, value, self.scale, starts, self.sliding_window,
                                             self.softcap)
        return self.backend.attend(query, key, value, ctx.kv_caches[self.layer_idx], metadata, self.scale,
                                   self.sliding_window, self.softcap)


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Make every ``Attention`` layer of ``model`` use ``backend``; ValueError (and no layer changed)
    when a layer needs a sliding window, soft-capping or the batch-invariant mode the backend lacks."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        if layer.sliding_window is not None and not backend.supports_sliding_window:
            raise ValueError(f"attention backend {backend.name!r} has no sliding-window attention, which layer "
                             f"{layer.layer_idx} of this model needs; use attention_backend='torch'")
        if layer.softcap is not None and not backend.supports_softcap:
            raise ValueError(f"attention backend {backend.name!r} has no attention soft-capping, which layer "
                             f"{layer.layer_idx} of this model needs; use attention_backend='torch'")
        if layer.batch_invariant and not getattr(backend, "batch_invariant", False):
            raise ValueError(f"layer {layer.layer_idx} was built in the batch-invariant mode; attention backend "
                             f"{backend.name!r} is not in it (make_attention_backend(..., batch_invariant=True))")
        if layer.batch_invariant and layer.head_dim not in cpu_op.SUPPORTED_HEAD_DIMS:
            # The op would hand this layer to the torch reference (SDPA), whose sums vary.
            raise ValueError(f"batch_invariant: layer {layer.layer_idx} has head_dim {layer.head_dim}; the compiled "
                             f"attention op takes {cpu_op.SUPPORTED_HEAD_DIMS}")
    for layer in layers:
        layer.backend = backend
