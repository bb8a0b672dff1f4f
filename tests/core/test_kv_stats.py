"""KV occupancy gauges (KVCacheManager.kv_stats): exact counts on scripted scenarios, each checked against a
full scan of the block pool and the block tables, and back to nothing held once idle."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, KVCacheStats
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler

from .helpers import make_request, make_scheduler, sample_for
from .test_beam_registry import _run as run_beam_workload
from .test_sharing import _sample_with_forks


def scan(kv: KVCacheManager, requests) -> KVCacheStats:
    """What kv_stats must say, found the slow way: walk every block and every block table.

    A block's fill is the most any holder has computed in it (a request's computed count includes the
    tokens scheduled in the current step)."""
    bs = kv.block_size
    holders: Counter[int] = Counter()
    fill: dict[int, int] = {}
    by_priority: Counter[int] = Counter()
    for req_id, table in kv.req_to_blocks.items():
        request = requests[req_id]
        by_priority[request.priority] += len(table)
        for i, block in enumerate(table):
            holders[block.block_id] += 1
            filled = min(bs, max(0, request.num_computed_tokens - i * bs))
            fill[block.block_id] = max(fill.get(block.block_id, 0), filled)
    blocks = kv.pool.blocks
    assert [b.ref_cnt for b in blocks] == [holders[b.block_id] for b in blocks]
    used = [b for b in blocks if b.ref_cnt > 0]
    num_refs = sum(holders.values())
    return KVCacheStats(
        num_blocks=len(blocks), block_size=bs, num_used_blocks=len(used),
        num_cached_blocks=sum(1 for b in blocks if b.ref_cnt == 0 and b.block_hash is not None),
        num_empty_blocks=sum(1 for b in blocks if b.ref_cnt == 0 and b.block_hash is None),
        num_filled_slots=sum(fill.values()), num_shared_blocks=sum(1 for b in used if b.ref_cnt > 1),
        num_block_refs=num_refs, num_allocated_slots=len(used) * bs, num_saved_blocks=num_refs - len(used),
        num_host_blocks=kv.num_host_blocks,
        num_swapped_blocks=sum(len(h) for h in kv.host.tables.values()),
        blocks_by_priority=dict(by_priority))


def check(kv: KVCacheManager, requests) -> KVCacheStats:
    stats = kv.kv_stats()
    assert stats == scan(kv, requests)
    # the block map's fill of a free block: a full block while it holds a cached prefix, else nothing
    ref_cnts, num_tokens, cached = kv.block_states()
    assert ref_cnts == [b.ref_cnt for b in kv.pool.blocks] and len(cached) == stats.num_cached_blocks
    assert all(num_tokens[b] == (kv.block_size if b in cached else 0) for b, ref in enumerate(ref_cnts) if not ref)
    assert stats.num_used_blocks + stats.num_cached_blocks + stats.num_empty_blocks == stats.num_blocks
    return stats


def assert_idle(kv: KVCacheManager) -> None:
    stats = kv.kv_stats()
    assert (stats.num_used_blocks, stats.num_filled_slots, stats.num_shared_blocks, stats.num_block_refs,
            stats.num_swapped_blocks, stats.blocks_by_priority) == (0, 0, 0, 0, 0, {})
    assert stats.num_cached_blocks + stats.num_empty_blocks == stats.num_blocks
    assert kv.check_no_leaks() == []


def _gauges(stats: KVCacheStats) -> tuple:
    return (stats.num_used_blocks, stats.num_cached_blocks, stats.num_empty_blocks, stats.num_filled_slots,
            stats.num_shared_blocks, stats.num_saved_blocks)


def test_parallel_samples_share_then_copy_on_write():
    # n=2 of an 11-token prompt, block size 4: blocks 0, 1 full, block 2 holds 3 of 4 slots.
    sched = make_scheduler(num_blocks=8, block_size=4)
    a1, a2 = make_request(11, max_tokens=3, req_id="A1"), make_request(11, max_tokens=3, req_id="A2")
    sched.add_request(a1, parallel_samples=[a2])
    out = sched.schedule()
    #                      used cached empty filled shared saved
    assert _gauges(check(sched.kv, sched.requests)) == (3, 0, 5, 11, 0, 0)  # the sample waits, holding nothing
    sched.update_from_output(out, _sample_with_forks(sched, out, {}))
    assert _gauges(check(sched.kv, sched.requests)) == (3, 0, 5, 11, 3, 3)  # forked: every block shared
    out = sched.schedule()  # A1 copies block 2 to 3, A2 writes block 2 in place
    assert out.block_copies == [(2, 3)]
    assert _gauges(check(sched.kv, sched.requests)) == (4, 0, 4, 16, 2, 2)
    assert sched.kv.kv_stats().num_allocated_slots == 16  # both partial blocks are now full
    sched.update_from_output(out, sample_for(sched, out))
    out = sched.schedule()  # position 12 of each: a new private block each
    assert _gauges(check(sched.kv, sched.requests)) == (6, 0, 2, 18, 2, 2)
    assert sched.kv.kv_stats().num_allocated_slots == 24
    sched.update_from_output(out, sample_for(sched, out))
    assert not sched.has_unfinished_requests()
    assert_idle(sched.kv)


def test_prefix_hits_share_blocks_and_finished_prompts_stay_cached():
    sched = make_scheduler(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request(9, max_tokens=3, req_id="a")
    sched.add_request(a)
    sched.update_from_output(out := sched.schedule(), sample_for(sched, out))
    assert _gauges(check(sched.kv, sched.requests)) == (3, 0, 5, 9, 0, 0)
    b = make_request(9, max_tokens=2, req_id="b")  # the same prompt: blocks 0 and 1 are hits
    sched.add_request(b)
    out = sched.schedule()
    assert sched.kv.get_block_ids("b")[:2] == [0, 1]
    # a: 10 tokens in blocks 0 1 2; b: hits 0 1 plus block 3 with 1 token
    assert _gauges(check(sched.kv, sched.requests)) == (4, 0, 4, 11, 2, 2)
    while sched.has_unfinished_requests():
        sched.update_from_output(out, sample_for(sched, out))
        out = sched.schedule()
        check(sched.kv, sched.requests)
    # a's prompt + outputs filled blocks 0, 1 (the prompt) and 2 (3 tokens: 11 in all), b's block 3 has 2 of 4
    stats = check(sched.kv, sched.requests)
    assert (stats.num_cached_blocks, stats.num_empty_blocks) == (2, 6)
    assert_idle(sched.kv)
    # a hit on a cached free block takes it out of the cached count
    c = make_request(9, max_tokens=1, req_id="c")
    sched.add_request(c)
    out = sched.schedule()
    assert _gauges(check(sched.kv, sched.requests)) == (3, 0, 5, 9, 0, 0)
    sched.update_from_output(out, sample_for(sched, out))
    assert_idle(sched.kv)
    assert sched.kv.reset_prefix_cache()
    assert _gauges(check(sched.kv, sched.requests)) == (0, 0, 8, 0, 0, 0)


def _swap_scheduler(num_blocks: int, mode: str) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, KVCacheManager(num_blocks, 4, False, num_host_blocks=16 if mode == "swap" else 0), mode)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_moves_blocks_to_host_or_frees_them(mode):
    sched = _swap_scheduler(num_blocks=5, mode=mode)
    first, second = make_request(8, max_tokens=8, req_id="first"), make_request(7, max_tokens=8, req_id="second")
    sched.add_request(first)
    sched.add_request(second)
    seen_swapped = []
    seen_preempted = False
    out = sched.schedule()
    assert _gauges(check(sched.kv, sched.requests)) == (4, 0, 1, 15, 0, 0)
    while sched.has_unfinished_requests():
        sched.update_from_output(out, sample_for(sched, out))
        out = sched.schedule()
        stats = check(sched.kv, sched.requests)
        seen_swapped.append(stats.num_swapped_blocks)
        if out.preempted_req_ids:
            seen_preempted = True
            # the newest (second) leaves: 2 blocks (its 8 tokens) go to the host, or are simply freed
            assert stats.num_swapped_blocks == (2 if mode == "swap" else 0)
            assert stats.num_used_blocks == 3  # first's 9th token took a third block
    assert seen_preempted and sched.num_preemptions >= 1
    assert max(seen_swapped) == (2 if mode == "swap" else 0)
    assert sched.num_swap_outs == (sched.num_preemptions if mode == "swap" else 0)
    assert_idle(sched.kv)


def test_abort_mid_prefill_and_between_schedule_and_update():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    a, b = make_request(10, max_tokens=4, req_id="a"), make_request(5, max_tokens=4, req_id="b")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # a's first chunk of 6
    assert _gauges(check(sched.kv, sched.requests)) == (2, 0, 6, 6, 0, 0)
    sched.update_from_output(out, sample_for(sched, out))
    out = sched.schedule()  # a's last 4, b's first 2
    assert _gauges(check(sched.kv, sched.requests)) == (4, 0, 4, 12, 0, 0)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # aborted with its step in flight
    assert _gauges(check(sched.kv, sched.requests)) == (1, 0, 7, 2, 0, 0)
    sched.update_from_output(out, sample_for(sched, out))
    check(sched.kv, sched.requests)
    out = sched.schedule()
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(out, sample_for(sched, out))
    assert not sched.has_unfinished_requests()
    assert_idle(sched.kv)


@pytest.mark.parametrize("mode, budget", [("recompute", 64), ("recompute", 7), ("swap", 64)])
def test_beam_groups_under_pressure_match_a_scan_every_step(mode, budget):
    seen = Counter()

    def check_step(sched, groups, out):
        stats = check(sched.kv, sched.requests)
        seen["shared"] = max(seen["shared"], stats.num_shared_blocks)
        seen["swapped"] = max(seen["swapped"], stats.num_swapped_blocks)
        seen["priorities"] = max(seen["priorities"], len(stats.blocks_by_priority))

    sched, _ = run_beam_workload(num_blocks=14, preemption_mode=mode, max_num_batched_tokens=budget,
                                 check=check_step, policy="priority", priorities={"A": 1, "G": 0, "B": 2, "H": 1})
    assert seen["shared"] > 0 and seen["priorities"] == 3  # beams shared blocks; three priorities held some
    assert (seen["swapped"] > 0) == (mode == "swap")
    assert sched.num_preemptions > 0
    assert_idle(sched.kv)


def test_blocks_by_priority_counts_table_entries_per_priority():
    sched = make_scheduler(num_blocks=16, block_size=4)
    low, high = make_request(9, req_id="low"), make_request(4, req_id="high")
    low.priority, high.priority = 5, -1
    sched.add_request(low)
    sched.add_request(high)
    sched.schedule()
    assert check(sched.kv, sched.requests).blocks_by_priority == {5: 3, -1: 1}
    sched.finish_requests(["low"], RequestStatus.FINISHED_ABORTED)
    assert check(sched.kv, sched.requests).blocks_by_priority == {-1: 1}


def test_speculative_rollback_unfills_rejected_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = make_request(5, req_id="r")
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    r.append_output_token(1)
    kv.allocate_slots(r, 1, num_lookahead_tokens=4)  # the sampled token and 4 proposals: 10 slots written
    r.num_computed_tokens = 10
    assert _gauges(check(kv, {"r": r})) == (3, 0, 5, 10, 0, 0)
    r.append_output_token(2)  # one proposal kept: positions 7.. are uncomputed again
    r.num_computed_tokens = 7
    assert kv.trim(r, 7) == 2
    assert _gauges(check(kv, {"r": r})) == (2, 0, 6, 7, 0, 0)
    kv.free(r)
    assert_idle(kv)


# --- property: random sequences of every operation that moves blocks --------------------------


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "swap_out", "swap_in", "spec"]),
                           st.integers(0, 10**6)), max_size=60),
    num_blocks=st.integers(4, 16),
    num_host_blocks=st.integers(0, 8),
)
def test_random_operations_keep_the_counters_equal_to_a_scan(ops, num_blocks, num_host_blocks):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=2, enable_caching=True, num_host_blocks=num_host_blocks)
    live, swapped = {}, {}
    for counter, (op, x) in enumerate(ops):
        if op == "new":
            request = make_request(1 + x % 7, req_id=f"n{counter}", first_token=100 + x % 2)
            request.priority = x % 3
            hits, num_hit = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None:
                request.num_computed_tokens = request.num_tokens
                live[request.req_id] = request
        elif live and op == "append":
            request = live[sorted(live)[x % len(live)]]
            num_new = 1 + x % 3
            for t in range(num_new):
                request.append_output_token(x % 5 + t)
            if kv.allocate_slots(request, num_new) is not None:
                request.num_computed_tokens += num_new
            else:
                del request.all_token_ids[-num_new:], request.output_token_ids[-num_new:]
        elif live and op == "fork":
            parent = live[sorted(live)[x % len(live)]]
            child = make_request(1, req_id=f"f{counter}")
            child.all_token_ids = list(parent.all_token_ids)
            child.prompt_token_ids = list(parent.prompt_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.priority = parent.priority
            kv.fork(parent, child)
            live[child.req_id] = child
        elif live and op == "free":
            kv.free(live.pop(sorted(live)[x % len(live)]))
        elif live and op == "swap_out":
            request = live[sorted(live)[x % len(live)]]
            if kv.swap_out(request) is not None:
                swapped[request.req_id] = live.pop(request.req_id)
        elif swapped and op == "swap_in":
            request = swapped[sorted(swapped)[x % len(swapped)]]
            request.append_output_token(3)
            if kv.swap_in(request, 1) is not None:
                request.num_computed_tokens += 1
                live[request.req_id] = swapped.pop(request.req_id)
            else:
                request.all_token_ids.pop(), request.output_token_ids.pop()
        elif live and op == "spec":  # a speculative step: k proposals written, `num_kept` of them kept
            request = live[sorted(live)[x % len(live)]]
            k = 1 + x % 4
            num_kept = (x // 4) % (k + 1)
            request.append_output_token(9)  # the token sampled last step, computed now
            if kv.allocate_slots(request, 1, num_lookahead_tokens=k) is not None:
                request.num_computed_tokens += 1 + k  # as the scheduler counts a step with proposals
                check(kv, {**live, **swapped})
                for t in range(num_kept):
                    request.append_output_token(20 + t)
                request.num_computed_tokens = request.num_tokens
                kv.trim(request, request.num_tokens)
            else:
                request.all_token_ids.pop(), request.output_token_ids.pop()
        kv.take_block_copies()
        check(kv, {**live, **swapped})
    for request in [*live.values(), *swapped.values()]:
        kv.free(request)
    assert_idle(kv)


def test_contiguous_baseline_reports_its_whole_reservation_as_allocated():
    from pagedllm.bench.contiguous_allocator import ContiguousKVCacheManager

    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4, policy="max", max_model_len=32)
    r = make_request(5, max_tokens=4, req_id="r")
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    stats = kv.kv_stats()
    assert (stats.num_used_blocks, stats.num_empty_blocks, stats.num_filled_slots, stats.num_allocated_slots,
            stats.num_saved_blocks, stats.blocks_by_priority) == (8, 8, 5, 32, 0, None)
    kv.free(r)
    stats = kv.kv_stats()
    assert (stats.num_used_blocks, stats.num_filled_slots) == (0, 0) and kv.check_no_leaks() == []
