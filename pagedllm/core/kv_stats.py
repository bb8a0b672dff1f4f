"""The KV cache's occupancy gauges, as the manager reports them (`KVCacheManager.kv_stats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Where the KV cache's memory is now: every device block is exactly one of used, cached or empty.

    Read from counters kept as blocks change hands (no scan); the builder fills the derived counts too, so
    reading a gauge runs no code. Only running requests hold blocks: a preempted request frees its blocks
    (recompute) or moves them to host blocks (swap)."""

    num_blocks: int
    block_size: int
    num_used_blocks: int
    """Held by at least one request."""
    num_cached_blocks: int
    """Held by nobody but still holding a cached prefix: reclaimable, reused on a prefix hit."""
    num_empty_blocks: int
    """Held by nobody, holding nothing."""
    num_filled_slots: int
    """Token slots of the used blocks that hold KV (or are written in the step just scheduled)."""
    num_shared_blocks: int
    """Used blocks held by more than one sequence (parallel samples, beams, prefix hits)."""
    num_block_refs: int
    """Block-table entries over all sequences: what the used blocks would be without sharing."""
    num_allocated_slots: int
    """Token slots of the used blocks, filled or not (filled / allocated: internal fragmentation)."""
    num_saved_blocks: int
    """Blocks sharing saves: block-table entries minus the distinct blocks they name."""
    num_host_blocks: int = 0
    """Swap space, in blocks."""
    num_swapped_blocks: int = 0
    """Host blocks holding swapped-out requests' KV."""
    blocks_by_priority: dict[int, int] | None = None
    """Block-table entries by request priority (a shared block counts once per holder); only priorities
    that hold blocks appear. None: the manager does not break its blocks down by priority."""
