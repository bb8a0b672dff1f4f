"""The one explicit channel through which attention layers see the step's metadata and KV caches.

The model runner wraps each forward pass in ``with set_forward_context(metadata, kv_caches):``;
every ``Attention`` layer reads ``get_forward_context()`` instead of threading metadata through
each ``forward`` signature.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedllm.model.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]; None = no cache.
    kv_caches: list[torch.Tensor] | None


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor] | None
) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` and ``kv_caches`` visible to attention layers for this block."""
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata, kv_caches)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext | None:
    """The context set by the innermost ``set_forward_context``, or None outside of one."""
    return _current
