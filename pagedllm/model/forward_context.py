"""The one explicit channel through which attention layers see the step's metadata and KV caches.

The model runner wraps each forward pass in ``with set_forward_context(metadata, kv_caches):``;
every ``Attention`` layer reads ``get_forward_context()`` instead of threading metadata through
each ``forward`` signature. A step with LoRA adapters also sets its rows' segments
(``set_lora_segments``, which ``pagedllm/lora``'s ``lora_step`` calls): the layers read them here, so
model/ needs nothing from lora/.
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


_lora_segments: list[int] = []


@contextmanager
def set_lora_segments(segments: list[int]) -> Iterator[None]:
    """Make ``segments`` (``[begin, end, slot, ...]`` over the step's rows) the rows whose linears add an adapter's
    delta during this block; [] = none."""
    global _lora_segments
    previous, _lora_segments = _lora_segments, segments
    try:
        yield
    finally:
        _lora_segments = previous


def get_lora_segments() -> list[int]:
    """The segments of the step in progress ([] outside ``set_lora_segments`` or for a step without adapters)."""
    return _lora_segments
