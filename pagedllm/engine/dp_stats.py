"""How the data-parallel replicas' stats become one engine-wide EngineStatsMsg: one rule per field
(``STATS_MERGE``, checked against the struct at import), and the counters of replica incarnations that died,
kept so that totals never go backwards."""

from __future__ import annotations

import collections
import enum
import functools
import itertools

from pagedllm.engine.protocol import EngineStatsMsg


class StatsMerge(enum.Enum):
    """How one EngineStatsMsg field of the replicas becomes the engine-wide total."""

    GAUGE_SUM = "gauge_sum"
    """A level now (requests, beams, blocks): summed over the live replicas; a dead one's leaves with it."""
    COUNTER_SUM = "counter_sum"
    """Cumulative: summed over every incarnation of every replica, so the total never goes backwards."""
    COUNTER_SUM_PER_POSITION = "counter_sum_per_position"
    """Cumulative lists indexed by position: summed position by position (a shorter list counts 0 past its end)."""
    MEAN_WEIGHTED_BY_BLOCKS = "mean_weighted_by_blocks"
    """A fraction of a replica's KV blocks: the mean weighted by each live replica's block count."""
    GAUGE_SUM_PER_KEY = "gauge_sum_per_key"
    """Levels by key (priority -> blocks): summed key by key over the live replicas."""
    PER_REPLICA = "per_replica"
    """Not merged (the block map): the total carries None; each replica's reaches the metrics under its label."""


_G, _C, _P = StatsMerge.GAUGE_SUM, StatsMerge.COUNTER_SUM, StatsMerge.COUNTER_SUM_PER_POSITION
STATS_MERGE: dict[str, StatsMerge] = {
    "num_running": _G, "num_waiting": _G, "kv_cache_usage": StatsMerge.MEAN_WEIGHTED_BY_BLOCKS,
    "num_preemptions": _C, "prefix_cache_queries": _C, "prefix_cache_hits": _C, "num_evictions": _C,
    "num_kv_leaks": _G, "num_swap_outs": _C,
    "kv_disk_hit_tokens": _C, "kv_disk_miss_blocks": _C, "kv_disk_stored_blocks": _C, "kv_disk_corrupt_blocks": _C,
    "kv_disk_load_seconds": _C, "kv_disk_store_seconds": _C, "kv_disk_blocks": _G, "kv_disk_bytes": _G,
    "kv_disk_max_bytes": _G, "kv_disk_num_loading": _G,
    "num_beam_groups": _G, "num_beams_running": _G, "num_beam_kv_blocks": _G, "num_beam_kv_blocks_saved": _G,
    "num_beam_group_preemptions": _C,
    "spec_num_steps": _C, "spec_num_draft_tokens": _C, "spec_num_accepted_tokens": _C, "spec_num_bonus_tokens": _C,
    "spec_accepted_per_position": _P, "spec_proposed_per_position": _P,
    "num_steps": _C, "num_scheduled_tokens": _C,
    "kv_num_blocks": _G, "kv_num_used_blocks": _G, "kv_num_cached_blocks": _G, "kv_num_empty_blocks": _G,
    "kv_num_filled_slots": _G, "kv_num_allocated_slots": _G, "kv_num_shared_blocks": _G, "kv_num_saved_blocks": _G,
    "kv_saved_bytes": _G, "kv_num_host_blocks": _G, "kv_num_swapped_blocks": _G,
    "kv_blocks_by_priority": StatsMerge.GAUGE_SUM_PER_KEY, "kv_map": StatsMerge.PER_REPLICA,
}
"""Every field of EngineStatsMsg and how it merges. Checked against the struct's own fields at import, so a new
field without a rule fails loudly instead of reading 0 on /metrics whenever -dp > 1."""
if set(STATS_MERGE) != set(EngineStatsMsg.__struct_fields__):
    raise TypeError("STATS_MERGE must name every EngineStatsMsg field exactly once; missing: "
                    f"{sorted(set(EngineStatsMsg.__struct_fields__) - set(STATS_MERGE))}, "
                    f"unknown: {sorted(set(STATS_MERGE) - set(EngineStatsMsg.__struct_fields__))}")
_CUMULATIVE = (StatsMerge.COUNTER_SUM, StatsMerge.COUNTER_SUM_PER_POSITION)


def _add_per_position(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


def retired_counters() -> dict[str, int | list[int]]:
    """Every cumulative field at zero: where the counters of replica incarnations that die are added up."""
    return {name: [] if how is StatsMerge.COUNTER_SUM_PER_POSITION else 0
            for name, how in STATS_MERGE.items() if how in _CUMULATIVE}


def retire(retired: dict[str, int | list[int]], last: EngineStatsMsg) -> None:
    """Add a dying replica incarnation's last counters to ``retired``."""
    for name, total in retired.items():
        value = getattr(last, name)
        retired[name] = _add_per_position(total, value) if isinstance(total, list) else total + value


def merge_stats(live: list[tuple[EngineStatsMsg, int]], retired: dict[str, int | list[int]]) -> EngineStatsMsg:
    """The engine-wide view of the live replicas' latest stats (each with its KV block count) and the
    ``retired`` counters: every field merged as STATS_MERGE says."""
    num_blocks = sum(n for _, n in live)
    total = {}
    for name, how in STATS_MERGE.items():
        values = [getattr(s, name) for s, _ in live]
        if how is StatsMerge.GAUGE_SUM:
            total[name] = sum(values)
        elif how is StatsMerge.COUNTER_SUM:
            total[name] = retired[name] + sum(values)
        elif how is StatsMerge.COUNTER_SUM_PER_POSITION:
            total[name] = functools.reduce(_add_per_position, values, retired[name])
        elif how is StatsMerge.GAUGE_SUM_PER_KEY:
            total[name] = dict(functools.reduce(lambda a, b: a + collections.Counter(b), values, collections.Counter()))
        elif how is StatsMerge.PER_REPLICA:
            total[name] = None
        else:  # MEAN_WEIGHTED_BY_BLOCKS
            total[name] = sum(v * n for v, (_, n) in zip(values, live)) / num_blocks if num_blocks else 0.0
    return EngineStatsMsg(**total)
