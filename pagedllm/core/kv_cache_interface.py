"""What the scheduler, its collaborators and the engine core need of a KV cache manager, and how one is made.

`KVCacheManager` (paged blocks) is the product's; benchmarks plug in other allocation policies
(contiguous reservations, bench/contiguous_allocator.py) here, and only here: inside
`with plugged_kv_cache_manager(factory):`, every engine core made (in this process, or in an engine-core
process spawned from it) builds its manager with `factory`. No other product file carries the factory.
Block ids in a returned table index the same KV tensors whichever manager handed them out, so the model
runner never knows.

The protocol lists every method anything in core/ calls on a manager: nothing reaches past it (into a
block pool, say). A manager that cannot do one of them (share blocks, swap) raises
`UnsupportedKVFeatureError` naming the feature, so a benchmark that asks for it fails with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, KVCacheStats
from pagedllm.core.request import Request


class UnsupportedKVFeatureError(NotImplementedError):
    """A KV cache manager was asked for something its allocation policy cannot do."""

    def __init__(self, manager: str, feature: str, hint: str) -> None:
        super().__init__(f"{manager} does not support {feature}; {hint}")
        self.feature = feature
        """What was asked: 'forking' (parallel sampling, beam search) or 'swapping'."""


class KVCacheManagerProtocol(Protocol):
    block_size: int
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache (0 without one)."""
    prefix_cache_hits: int
    """Of those, tokens served from cached blocks."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (beam groups check a whole group's bound against it)."""

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use, in [0, 1]."""

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far to make room."""

    def num_blocks_for_tokens(self, num_tokens: int) -> int: ...

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one sequence growing to `num_tokens`, at most `max_step_tokens` a step, holds at
        once (what admission refuses by; less than its whole length when blocks behind a window are freed)."""

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table (empty if it holds none)."""

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Prefix-cache hits for a waiting request, and how many tokens they hold."""

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence = (),
                       num_headroom_blocks: int = 0, num_lookahead_tokens: int = 0) -> list[int] | None:
        """Room for `num_new_tokens` more tokens; the block ids appended, or None if they do not fit
        while leaving `num_headroom_blocks` free (admission keeps room for running requests to grow;
        a manager that reserves a request's whole length up front may ignore it).
        `num_lookahead_tokens` more slots follow for speculative proposals (rolled back by `trim`)."""

    def trim(self, request: Request, num_tokens: int) -> int:
        """Speculative rollback: drop the tail blocks holding none of the first `num_tokens` slots;
        returns the block table's length afterwards."""

    def free(self, request: Request, keep_host_blocks: bool = False) -> None: ...

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's blocks (parallel sampling, beam search), or raise UnsupportedKVFeatureError."""

    def take_block_copies(self) -> list[tuple[int, int]]: ...

    def take_replaced_blocks(self, req_id: str) -> dict[int, int]:
        """Entries of the request's table replaced since the last call (index -> new block id), then forgotten."""

    def forget_replaced_blocks(self, req_id: str) -> None:
        """Forget the request's replaced entries unread: its whole table is sent instead."""

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's KV to host blocks; None if it cannot (the scheduler then recomputes)."""

    def is_swapped_out(self, request: Request) -> bool: ...

    def swap_in(self, request: Request, num_new_tokens: int,
                num_headroom_blocks: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back (host -> device copies); None if it does not fit."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False if some are still in use."""

    def check_no_leaks(self) -> list[str]:
        """With no request alive: what is still held (empty = fine)."""

    def kv_stats(self) -> KVCacheStats:
        """Occupancy now (used / cached / empty blocks, filled slots, sharing, swap), read from counters the
        manager keeps as blocks change hands: the engine core calls it after every step."""

    def block_states(self) -> tuple[list[int], list[int], list[int]]:
        """(ref_cnt per block, filled slots per block, ids of free blocks holding a cached prefix): a walk of
        every block, for the block map (only built while someone watches)."""


class KVCacheManagerFactory(Protocol):
    def __call__(self, num_blocks: int, num_host_blocks: int, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig) -> KVCacheManagerProtocol:
        """A manager over `num_blocks` device blocks (and `num_host_blocks` swap blocks)."""


def paged_kv_cache_manager(num_blocks: int, num_host_blocks: int, cache_config: CacheConfig,
                           scheduler_config: SchedulerConfig, sliding_window: int | None = None) -> KVCacheManagerProtocol:
    """The product's factory: paged blocks, prefix caching as configured, swap space if any; with the
    `sliding_window` every layer shares, blocks behind it are freed (the engine core passes the executor's)."""
    return KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                          num_host_blocks=num_host_blocks, sliding_window=sliding_window)


_plugged: KVCacheManagerFactory | None = None


@contextmanager
def plugged_kv_cache_manager(factory: KVCacheManagerFactory | None) -> Iterator[None]:
    """Engine cores made inside this block build their KV cache manager with ``factory`` (picklable: it crosses
    into spawned engine-core processes) instead of the paged one; None = the paged one."""
    global _plugged
    previous, _plugged = _plugged, factory
    try:
        yield
    finally:
        _plugged = previous


def plugged_factory() -> KVCacheManagerFactory | None:
    """The factory plugged in by ``plugged_kv_cache_manager``, or None (the product's paged manager)."""
    return _plugged
