"""The engine core's stats as it sends them (inside `engine/protocol.py`'s messages): gauges, cumulative counters and
the block map. Declared here, below the engine, so that the metrics read them without importing the engine."""

from __future__ import annotations

import msgspec


class KVMapRequest(msgspec.Struct, array_like=True):
    """One live request in a KVMapMsg."""

    req_id: str
    state: str
    """'running', 'waiting', 'swapped' (its KV on the host) or 'preempted' (to be recomputed)."""
    priority: int
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    """Its block table (empty unless running)."""


class KVMapMsg(msgspec.Struct):
    """The KV block pool and the queues at one moment between steps: what the dashboard draws.

    Per block (index = block id): `ref_cnts` (0 = free; > 1 = shared), `num_tokens` (slots holding KV: a
    full block for a cached free one, 0 for an empty one) and the free blocks still holding a cached prefix
    (`cached_block_ids`)."""

    timestamp: float
    """time.time() in the core when it was built."""
    block_size: int
    ref_cnts: list[int]
    num_tokens: list[int]
    cached_block_ids: list[int]
    requests: list[KVMapRequest]
    num_steps: int
    """Steps run so far (cumulative, like the counters below)."""
    num_scheduled_tokens: int
    num_preemptions: int
    num_swap_outs: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    build_time_s: float = 0.0
    """How long building this map took in the core (between two steps)."""


class EngineStatsMsg(msgspec.Struct):
    """A snapshot of the core's gauges and cumulative counters.

    A new field also needs its rule in dp_stats.STATS_MERGE (how replicas add up; checked at import)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_kv_leaks: int = 0
    """Problems found by the last idle leak check (0 = every block free or cached)."""
    num_swap_outs: int = 0
    """Preemptions that swapped the request's KV out to host memory (the rest recompute)."""
    kv_disk_hit_tokens: int = 0
    """Prompt tokens read back from the KV disk tier instead of recomputed (also in prefix_cache_hits)."""
    kv_disk_miss_blocks: int = 0
    """Lookups on disk after a memory miss that found nothing usable (absent or failing their check)."""
    kv_disk_stored_blocks: int = 0
    kv_disk_corrupt_blocks: int = 0
    kv_disk_load_seconds: float = 0.0
    kv_disk_store_seconds: float = 0.0
    kv_disk_blocks: int = 0
    """Blocks on disk now (gauge)."""
    kv_disk_bytes: int = 0
    kv_disk_max_bytes: int = 0
    """The disk tier's size limit (0: the tier is off)."""
    kv_disk_num_loading: int = 0
    """Requests waiting for their prefix blocks to be read from disk (also counted in num_waiting)."""
    num_beam_groups: int = 0
    """Beam-search requests live in the core."""
    num_beams_running: int = 0
    """Their beams (each a core request), running or preempted."""
    num_beam_kv_blocks: int = 0
    """Distinct KV blocks those beams hold."""
    num_beam_kv_blocks_saved: int = 0
    """Blocks their sharing saves: the sum of the beams' block-table lengths minus the distinct blocks."""
    num_beam_group_preemptions: int = 0
    """Beam groups preempted, each as a whole (cumulative)."""
    spec_num_steps: int = 0
    """Speculative decoding (cumulative): request-steps that carried proposals."""
    spec_num_draft_tokens: int = 0
    """Proposed tokens scored."""
    spec_num_accepted_tokens: int = 0
    """Proposals kept (the model agreed)."""
    spec_num_bonus_tokens: int = 0
    """Tokens the model added after the accepted proposals."""
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    """[j]: proposals at position j kept; divided by spec_proposed_per_position[j], the acceptance rate there."""
    spec_proposed_per_position: list[int] = msgspec.field(default_factory=list)
    """[j]: proposals at position j scored."""
    num_steps: int = 0
    """Steps run (cumulative)."""
    num_scheduled_tokens: int = 0
    """Tokens computed in those steps, prompt and output (cumulative)."""
    kv_num_blocks: int = 0
    """KV occupancy (KVCacheStats): device blocks in all; each is exactly one of used, cached or empty."""
    kv_num_used_blocks: int = 0
    """Held by running requests."""
    kv_num_cached_blocks: int = 0
    """Held by nobody, still holding a cached prefix: reclaimable."""
    kv_num_empty_blocks: int = 0
    """Held by nobody, holding nothing."""
    kv_num_filled_slots: int = 0
    """Token slots of the used blocks holding KV."""
    kv_num_allocated_slots: int = 0
    """Token slots of the used blocks (used blocks x block size)."""
    kv_num_shared_blocks: int = 0
    """Used blocks held by more than one sequence."""
    kv_num_saved_blocks: int = 0
    """Blocks sharing saves (block-table entries minus distinct used blocks)."""
    kv_saved_bytes: int = 0
    """Those blocks in bytes (over every tensor-parallel rank)."""
    kv_num_host_blocks: int = 0
    """Swap space in blocks."""
    kv_num_swapped_blocks: int = 0
    """Host blocks holding swapped-out requests' KV."""
    kv_blocks_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    """Block-table entries of running requests by priority (a shared block counts once per holder)."""
    kv_map: KVMapMsg | None = None
    """The block map, only while watched (watch_kv_map) and at most every KV_MAP_INTERVAL_S."""
