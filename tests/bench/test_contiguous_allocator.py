"""The contiguous-reservation baselines: allocators' invariants and the KV manager's contract."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.bench.contiguous_allocator import (
    BuddyAllocator,
    ContiguousKVCacheManager,
    FirstFitAllocator,
    next_power_of_two,
)
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def _request(req_id: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(req_id, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   frozenset(), max_tokens)


def _assert_disjoint(ranges: list[tuple[int, int]], num_blocks: int) -> None:
    ranges = sorted(ranges)
    for (s1, l1), (s2, _) in zip(ranges, ranges[1:]):
        assert s1 + l1 <= s2, f"overlap: {ranges}"
    assert all(0 <= s and s + n <= num_blocks for s, n in ranges)


def test_first_fit_takes_the_lowest_hole_and_coalesces_on_free():
    a = FirstFitAllocator(10)
    assert [a.alloc(3), a.alloc(3), a.alloc(3)] == [0, 3, 6]
    assert a.alloc(2) is None  # one block left
    a.free(3)
    assert a.holes() == [(3, 3), (9, 1)]
    assert a.alloc(4) is None  # 4 blocks free in total, but no hole of 4: external fragmentation
    a.free(0)
    assert a.holes() == [(0, 6), (9, 1)]  # merged left and right
    assert a.alloc(4) == 0
    a.free(0)
    a.free(6)
    assert a.holes() == [(0, 10)] and a.num_free == 10


def test_buddy_rounds_up_aligns_and_merges_buddies():
    a = BuddyAllocator(16)
    assert a.alloc(3) == 0 and a.size_of(0) == 4
    assert a.alloc(1) == 4 and a.size_of(4) == 1
    assert a.alloc(8) == 8
    assert a.num_free == 16 - 4 - 1 - 8
    assert a.alloc(4) is None  # 3 free blocks left, in pieces of 1 and 2
    a.free(4)
    assert a.holes() == [(4, 4)]  # 4 merged with 5, then with 6..7
    a.free(0)
    a.free(8)
    assert a.holes() == [(0, 16)]


def test_buddy_on_a_space_that_is_not_a_power_of_two():
    a = BuddyAllocator(12)
    assert a.holes() == [(0, 8), (8, 4)]
    assert a.alloc(8) == 0 and a.alloc(4) == 8 and a.alloc(1) is None
    a.free(8)
    a.free(0)
    assert a.holes() == [(0, 8), (8, 4)]  # never merged across the two chunks


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([FirstFitAllocator, BuddyAllocator]), st.integers(1, 64),
       st.lists(st.tuples(st.booleans(), st.integers(1, 20)), max_size=60))
def test_allocators_never_overlap_and_fully_coalesce(cls, num_blocks, ops):
    a = cls(num_blocks)
    taken: dict[int, int] = {}
    for is_alloc, value in ops:
        if is_alloc or not taken:
            start = a.alloc(value)
            if start is None:
                largest = max((n for _, n in a.holes()), default=0)
                assert largest < (value if cls is FirstFitAllocator else next_power_of_two(value))
                continue
            taken[start] = a.size_of(start)
            assert taken[start] >= value
        else:
            start = sorted(taken)[value % len(taken)]
            a.free(start)
            del taken[start]
        _assert_disjoint(list(taken.items()) + a.holes(), num_blocks)
        assert a.num_free == num_blocks - sum(taken.values()) == sum(n for _, n in a.holes())
    for start in list(taken):
        a.free(start)
    expected = [(0, num_blocks)] if cls is FirstFitAllocator else BuddyAllocator(num_blocks).holes()
    assert a.holes() == expected


@pytest.mark.parametrize("policy, expected_blocks", [("max", 16), ("pow2", 8), ("oracle", 6)])
def test_manager_reserves_per_policy_and_hands_out_consecutive_blocks(policy, expected_blocks):
    kv = ContiguousKVCacheManager(num_blocks=20, block_size=4, policy=policy, max_model_len=64)
    req = _request("a", prompt_len=10, max_tokens=11)  # final length 21: pow2 -> 32 tokens, oracle -> 21
    assert kv.allocate_slots(req, 10) == [0, 1, 2]  # the prompt's blocks, at the start of the region
    assert kv.regions["a"].num_blocks == expected_blocks
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) == []  # still inside block 2
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.usage == pytest.approx(expected_blocks / 20)
    kv.free(req)
    assert kv.check_no_leaks() == []


def test_admission_fails_when_no_hole_fits_though_enough_blocks_are_free():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=4, policy="oracle", max_model_len=48)
    a, b, c = _request("a", 8, 8), _request("b", 8, 8), _request("c", 8, 8)  # 4 blocks each
    for r in (a, b, c):
        assert kv.allocate_slots(r, 8) is not None
    kv.free(a)
    kv.free(c)
    big = _request("big", 16, 16)  # 8 blocks: 8 free, but as two holes of 4
    assert kv.allocate_slots(big, 16) is None
    assert kv.last_admission_failure == (8, 8)
    kv.free(b)
    assert kv.allocate_slots(big, 16) == [0, 1, 2, 3]


def test_max_policy_refuses_a_cache_smaller_than_max_model_len():
    with pytest.raises(ValueError, match="max_model_len"):
        ContiguousKVCacheManager(num_blocks=4, block_size=16, policy="max", max_model_len=128)


def test_manager_has_every_method_of_the_protocol_the_scheduler_calls():
    """Every member of KVCacheManagerProtocol exists with the protocol's parameters, so a scheduler or a
    collaborator never meets an AttributeError or a TypeError deep in a step."""
    import inspect

    from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol

    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, policy="oracle", max_model_len=32)
    members = [n for n in vars(KVCacheManagerProtocol) if not n.startswith("_")]
    assert {"allocate_slots", "trim", "num_free_blocks", "fork", "swap_in"} <= set(members)
    for name in members:
        assert hasattr(kv, name), name
        wanted = getattr(KVCacheManagerProtocol, name)
        if inspect.isfunction(wanted):
            assert list(inspect.signature(getattr(kv, name)).parameters) == \
                list(inspect.signature(wanted).parameters)[1:], name


def test_forking_and_swapping_are_refused_with_a_typed_error_naming_the_feature():
    from pagedllm.core.kv_cache_interface import UnsupportedKVFeatureError

    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, policy="pow2", max_model_len=32)
    a = _request("a", 4, 4)
    assert kv.allocate_slots(a, 4) == [0]
    with pytest.raises(UnsupportedKVFeatureError, match="does not support forking") as info:
        kv.fork(a, _request("b", 4, 4))
    assert info.value.feature == "forking"
    assert kv.swap_out(a) is None  # declined: the scheduler recomputes instead
    with pytest.raises(UnsupportedKVFeatureError, match="does not support swapping"):
        kv.swap_in(a, 1)


def test_speculative_slots_are_handed_out_and_trimmed_back_inside_the_region():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, policy="oracle", max_model_len=32)
    a = _request("a", 5, 7)  # final length 12: a region of 3 blocks
    assert kv.allocate_slots(a, 5) == [0, 1]
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=3) == [2]  # 9 slots
    assert kv.num_free_blocks == 5
    assert kv.trim(a, 6) == 2  # the rollback: block 2 held only rejected proposals
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=7) is None  # past the region: run plainly
    assert kv.allocate_slots(a, 1) == []


def test_the_scheduler_speculates_over_a_contiguous_manager():
    """n-gram speculation end to end with the baseline: proposals scheduled, rejected ones rolled back."""
    from pagedllm.config import SchedulerConfig, SpeculativeConfig
    from pagedllm.core.sched_output import ModelRunnerOutput
    from pagedllm.core.scheduler import Scheduler

    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4, policy="oracle", max_model_len=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64), kv,
                      speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    req = Request("a", [5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=8, ignore_eos=True), frozenset(), 8)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [6]}))
    out = sched.schedule()
    assert out.scheduled_spec_tokens == {"a": [7, 5, 6]} and out.num_scheduled_tokens == {"a": 4}
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [7, 9]}))  # one kept, then 9
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    assert kv.get_block_ids("a") == [0, 1, 2]
