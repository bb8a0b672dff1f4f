"""Contiguous-reservation KV allocation: the baselines paged memory is measured against.

Before paging, a serving system reserved one contiguous KV region per request at admission and
held it until the request finished (Orca and FasterTransformer as the vLLM paper models them).
`ContiguousKVCacheManager` does exactly that inside the same block-granular slot space as the
paged manager, so the same scheduler and model runner serve it unchanged and a run's outputs
are identical to the paged run's (the block table is simply the region's consecutive ids):

    slot space (blocks):  [ A A A A A A A A | . . . | B B B B | . . . . . . | C C ]
                            ^ region of A            ^ region of B         ^ hole too small for D?
    block table of A:     [ 0 1 2 3 ]  grows to [ 0 1 2 3 4 5 ] as A's tokens are computed,
                                        never past its region [0, 8)

How much each request reserves is the policy:

    max     max_model_len tokens (the request's final length is unknown)
    pow2    the next power of two of its final length (over-reserves by < 2x)
    oracle  exactly its final length

A request's *final length* is `num_prompt_tokens + max_tokens`: exact when a request runs to
max_tokens (benchmarks set ignore_eos and max_tokens = the trace's output length), an upper
bound otherwise. Reservations are rounded up to whole blocks and capped at max_model_len.

Regions are placed by a first-fit allocator (exact sizes) or a buddy allocator (sizes rounded up
to a power of two blocks, with coalescing of freed buddies), so external fragmentation is real:
admission fails (None) when no hole is large enough, even if the free blocks add up.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_interface import KVCacheStats, UnsupportedKVFeatureError
from pagedllm.core.kv_cache_manager import cdiv
from pagedllm.core.request import Request

KV_ALLOCATION_POLICIES = ("paged", "max", "pow2", "oracle")
CONTIGUOUS_ALLOCATORS = ("first_fit", "buddy")


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# --- allocators over [0, num_blocks) ---------------------------------------------------------


class FirstFitAllocator:
    """Variable-size contiguous ranges; the lowest hole that fits wins; freed ranges merge with neighbours."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._hole_starts: list[int] = [0] if num_blocks else []
        self._hole_len: dict[int, int] = {0: num_blocks} if num_blocks else {}
        self._taken: dict[int, int] = {}  # start -> length
        self.num_free = num_blocks

    def alloc(self, num: int) -> int | None:
        """Take `num` consecutive blocks; their first id, or None if no hole is large enough."""
        assert num >= 1
        for start in self._hole_starts:
            length = self._hole_len[start]
            if length >= num:
                self._remove_hole(start)
                if length > num:
                    self._add_hole(start + num, length - num)
                self._taken[start] = num
                self.num_free -= num
                return start
        return None

    def free(self, start: int) -> None:
        length = self._taken.pop(start)
        self.num_free += length
        i = bisect.bisect_left(self._hole_starts, start)
        if i < len(self._hole_starts) and self._hole_starts[i] == start + length:  # merge right
            nxt = self._hole_starts[i]
            length += self._hole_len[nxt]
            self._remove_hole(nxt)
        if i > 0:  # merge left
            prev = self._hole_starts[i - 1]
            if prev + self._hole_len[prev] == start:
                self._hole_len[prev] += length
                return
        self._add_hole(start, length)

    def size_of(self, start: int) -> int:
        """Blocks actually taken by the range at `start`."""
        return self._taken[start]

    def holes(self) -> list[tuple[int, int]]:
        """Free ranges as (start, length), in address order."""
        return [(s, self._hole_len[s]) for s in self._hole_starts]

    def _add_hole(self, start: int, length: int) -> None:
        bisect.insort(self._hole_starts, start)
        self._hole_len[start] = length

    def _remove_hole(self, start: int) -> None:
        self._hole_starts.pop(bisect.bisect_left(self._hole_starts, start))
        del self._hole_len[start]


class BuddyAllocator:
    """Power-of-two ranges aligned to their size; a freed range merges with its free buddy.

    A slot space that is not a power of two starts as its binary decomposition from 0
    (e.g. 12 blocks = [0, 8) + [8, 12)); alignment keeps every buddy inside one such chunk.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.max_order = max(num_blocks.bit_length() - 1, 0)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._taken: dict[int, int] = {}  # start -> order
        self.num_free = num_blocks
        start = 0
        for order in range(self.max_order, -1, -1):
            if num_blocks & (1 << order):
                self._free[order].add(start)
                start += 1 << order

    def alloc(self, num: int) -> int | None:
        """Take 2**ceil(log2(num)) aligned blocks; their first id, or None if no free range is large enough."""
        assert num >= 1
        order = (num - 1).bit_length()
        if order > self.max_order:
            return None
        j = next((j for j in range(order, self.max_order + 1) if self._free[j]), None)
        if j is None:
            return None
        start = min(self._free[j])  # lowest address: deterministic, and keeps the top of the space whole
        self._free[j].remove(start)
        while j > order:  # split, keeping the lower half
            j -= 1
            self._free[j].add(start + (1 << j))
        self._taken[start] = order
        self.num_free -= 1 << order
        return start

    def free(self, start: int) -> None:
        order = self._taken.pop(start)
        self.num_free += 1 << order
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)

    def size_of(self, start: int) -> int:
        return 1 << self._taken[start]

    def holes(self) -> list[tuple[int, int]]:
        return sorted((s, 1 << order) for order, starts in enumerate(self._free) for s in starts)


def make_allocator(name: str, num_blocks: int) -> FirstFitAllocator | BuddyAllocator:
    if name == "first_fit":
        return FirstFitAllocator(num_blocks)
    if name == "buddy":
        return BuddyAllocator(num_blocks)
    raise ValueError(f"unknown contiguous allocator {name!r}; choose from {CONTIGUOUS_ALLOCATORS}")


# --- the KV cache manager -----------------------------------------------------------------


@dataclass(slots=True)
class Region:
    start: int
    """First block id."""
    num_blocks: int
    """Blocks the allocator gave (the policy's reservation, rounded up by a buddy allocator)."""
    num_handed: int
    """Blocks handed to the block table so far (they cover the computed and scheduled tokens)."""
    final_len: int
    """The request's final length in tokens (prompt + max_tokens)."""
    num_tokens: int = 0
    """Slots holding KV (the computed and scheduled tokens)."""


class ContiguousKVCacheManager:
    """The KV cache manager protocol (core/kv_cache_interface.py) over one contiguous,
    reserved-at-admission region per request.

    No prefix caching, no sharing and no swapping: each is a capability of paged memory. Asked to
    share (fork) or swap, it raises UnsupportedKVFeatureError; speculative slots fit in the region.
    """

    def __init__(self, num_blocks: int, block_size: int, policy: str, max_model_len: int,
                 allocator: str = "first_fit") -> None:
        if policy not in KV_ALLOCATION_POLICIES or policy == "paged":
            raise ValueError(f"contiguous policy must be one of max, pow2, oracle; got {policy!r}")
        if policy == "max" and cdiv(max_model_len, block_size) > num_blocks:
            raise ValueError(
                f"the 'max' policy reserves max_model_len={max_model_len} tokens per request but the KV cache "
                f"holds {num_blocks * block_size}; lower max_model_len or raise kv_cache_memory"
            )
        self.block_size = block_size
        self.policy = policy
        self.max_model_len = max_model_len
        self.allocator_name = allocator
        self.allocator = make_allocator(allocator, num_blocks)
        self.enable_caching = False
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_cow_copies = 0
        self.regions: dict[str, Region] = {}
        self.num_filled_slots = 0
        """The sum of the regions' num_tokens."""
        self.num_admission_failures = 0
        self.last_admission_failure: tuple[int, int] | None = None
        """(blocks the refused request needed, free blocks then) of the latest refusal; the benchmark drains it."""

    # --- the KVCacheManager interface ------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in all holes together (a new region also needs them in one hole)."""
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.num_blocks

    @property
    def num_evictions(self) -> int:
        return 0  # nothing is cached, so nothing is evicted

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        return self.num_blocks_for_tokens(num_tokens)  # a region holds the whole sequence

    def get_block_ids(self, req_id: str) -> list[int]:
        region = self.regions.get(req_id)
        return [] if region is None else list(range(region.start, region.start + region.num_handed))

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        return [], 0

    def reservation_tokens(self, request: Request) -> int:
        """Tokens this policy reserves for `request` at admission."""
        final_len = request.num_prompt_tokens + request.max_tokens
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":
            return min(next_power_of_two(final_len), self.max_model_len)
        return min(final_len, self.max_model_len)

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence = (),
                       num_headroom_blocks: int = 0, num_lookahead_tokens: int = 0) -> list[int] | None:
        """Reserve the request's region at its first call (None if no hole fits); then hand out its next blocks.

        A region already holds the request's whole reservation, so no headroom is needed for growth.
        Speculative lookahead slots past the region are refused (None): the request then runs plainly."""
        assert not new_computed_blocks, "contiguous regions do not share prefix-cached blocks"
        region = self.regions.get(request.req_id)
        if region is None:
            num_reserved = self.num_blocks_for_tokens(self.reservation_tokens(request))
            start = self.allocator.alloc(num_reserved)
            if start is None:
                self.num_admission_failures += 1
                self.last_admission_failure = (num_reserved, self.allocator.num_free)
                return None
            region = Region(start, self.allocator.size_of(start), 0,
                            min(request.num_prompt_tokens + request.max_tokens, self.max_model_len))
            self.regions[request.req_id] = region
        num_needed = self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens)
        if num_lookahead_tokens and num_needed > region.num_blocks:
            return None
        self._set_filled(region, request.num_computed_tokens + num_new_tokens)
        assert num_needed <= region.num_blocks, (
            f"{request.req_id} outgrew its reservation ({num_needed} > {region.num_blocks} blocks)"
        )
        if num_needed <= region.num_handed:
            return []
        new_ids = list(range(region.start + region.num_handed, region.start + num_needed))
        region.num_handed = num_needed
        return new_ids

    def free(self, request: Request, keep_host_blocks: bool = False) -> None:
        region = self.regions.pop(request.req_id, None)
        if region is not None:
            self.num_filled_slots -= region.num_tokens
            self.allocator.free(region.start)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Speculative rollback: stop handing out the region's blocks past `num_tokens` (they stay reserved)."""
        region = self.regions.get(request.req_id)
        if region is None:
            return 0
        region.num_handed = min(region.num_handed, self.num_blocks_for_tokens(num_tokens))
        self._set_filled(region, min(region.num_tokens, num_tokens))
        return region.num_handed

    def _set_filled(self, region: Region, num_tokens: int) -> None:
        self.num_filled_slots += num_tokens - region.num_tokens
        region.num_tokens = num_tokens

    def block_states(self) -> tuple[list[int], list[int], list[int]]:
        """A reserved region's blocks have ref_cnt 1 (handed out or not); its tokens fill them from the start."""
        ref_cnts, num_tokens = [0] * self.num_blocks, [0] * self.num_blocks
        bs = self.block_size
        for region in self.regions.values():
            for i in range(region.num_blocks):
                ref_cnts[region.start + i] = 1
                num_tokens[region.start + i] = max(0, min(bs, region.num_tokens - i * bs))
        return ref_cnts, num_tokens, []

    def kv_stats(self) -> KVCacheStats:
        """A whole reservation counts as used from admission on: the slots it reserves but fills not yet are
        what filled / allocated shows. Nothing is cached, shared or swapped; no breakdown by priority (None)."""
        num_used = self.num_blocks - self.allocator.num_free
        return KVCacheStats(num_blocks=self.num_blocks, block_size=self.block_size, num_used_blocks=num_used,
                            num_cached_blocks=0, num_empty_blocks=self.allocator.num_free,
                            num_filled_slots=self.num_filled_slots, num_shared_blocks=0, num_block_refs=num_used,
                            num_allocated_slots=num_used * self.block_size, num_saved_blocks=0)

    def fork(self, parent: Request, child: Request) -> None:
        raise UnsupportedKVFeatureError(f"the {self.policy!r} contiguous policy", "forking",
                                        "it cannot share blocks between sequences: use n=1 without beam search, "
                                        "or the 'paged' policy")

    def take_block_copies(self) -> list[tuple[int, int]]:
        return []

    def take_replaced_blocks(self, req_id: str) -> dict[int, int]:
        return {}

    def forget_replaced_blocks(self, req_id: str) -> None:
        pass  # no copy-on-write, no window: nothing is ever replaced

    def swap_out(self, request: Request) -> None:
        return None  # not supported: the scheduler falls back to recomputation

    def is_swapped_out(self, request: Request) -> bool:
        return False

    def swap_in(self, request: Request, num_new_tokens: int,
                num_headroom_blocks: int = 0) -> list[tuple[int, int]] | None:
        raise UnsupportedKVFeatureError(f"the {self.policy!r} contiguous policy", "swapping",
                                        "a preempted request is recomputed (swap_out always declines)")

    def reset_prefix_cache(self) -> bool:
        return True

    def check_no_leaks(self) -> list[str]:
        problems = []
        if self.regions:
            problems.append(f"requests still hold regions: {sorted(self.regions)}")
        if self.allocator.num_free != self.num_blocks:
            problems.append(f"{self.num_blocks - self.allocator.num_free} blocks not returned to the allocator")
        if len(self.allocator.holes()) != (1 if isinstance(self.allocator, FirstFitAllocator) else
                                            bin(self.num_blocks).count("1")):
            problems.append(f"free space did not coalesce: holes {self.allocator.holes()[:10]}")
        return problems


@dataclass(frozen=True)
class ContiguousPolicy:
    """A KV cache manager factory for EngineCore: `policy` reservations placed by `allocator`.

    A plain frozen dataclass so that it pickles into a spawned engine-core process.
    """

    policy: str
    allocator: str = "first_fit"

    def __post_init__(self) -> None:
        if self.policy not in KV_ALLOCATION_POLICIES or self.policy == "paged":
            raise ValueError(f"contiguous policy must be one of max, pow2, oracle; got {self.policy!r}")
        if self.allocator not in CONTIGUOUS_ALLOCATORS:
            raise ValueError(f"unknown contiguous allocator {self.allocator!r}; choose from {CONTIGUOUS_ALLOCATORS}")

    def __call__(self, num_blocks: int, num_host_blocks: int, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig) -> ContiguousKVCacheManager:
        return ContiguousKVCacheManager(num_blocks, cache_config.block_size, self.policy,
                                        scheduler_config.max_model_len, self.allocator)


def kv_cache_manager_factory(policy: str, allocator: str = "first_fit") -> ContiguousPolicy | None:
    """The factory for a `--policies` name: None (the engine's own paged manager) for 'paged'."""
    return None if policy == "paged" else ContiguousPolicy(policy, allocator)
