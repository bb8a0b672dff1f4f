"""Blocks freed behind a sliding window (KVCacheManager(sliding_window=W)).

The bound asserted throughout: in a step that writes C slots from position n (n = num_computed_tokens
when scheduled), a request holds the blocks of positions max(0, n - W + 1) .. n + C - 1, at most
ceil((W - 1 + C) / block_size) + 1 of them; a decode step (C = 1) holds at most ceil(W / block_size) + 1.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import InvalidRequestError

from .helpers import make_request
from .helpers import step as run_step
from .test_scheduler import _check_block_invariants
from .test_spec_scheduler import BLOCK_SIZE, DRAFT_DIR, FakeKVRunner, _add

W = 6


def _live(kv: KVCacheManager, req) -> list[int]:
    return [b for b in kv.get_block_ids(req.req_id) if b != kv.null_block.block_id]


def test_decode_holds_only_the_window_and_frees_oldest_first():
    kv = KVCacheManager(num_blocks=17, block_size=4, enable_caching=False, sliding_window=W)
    assert kv.num_blocks == 16 and kv.null_block.block_id == 16  # the last id is kept back, never handed out
    req = make_request(10, max_tokens=100)
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10  # the next query (10) reads keys 5..10: block 0 (0..3) is dead
    for n in range(10, 60):
        kv.allocate_slots(req, 1)
        table = kv.get_block_ids(req.req_id)
        num_dead = max(0, n - W + 1) // 4
        assert table[:num_dead] == [16] * num_dead and 16 not in table[num_dead:]
        assert len(table) == cdiv(n + 1, 4) and kv.num_live_blocks(req.req_id) <= cdiv(W, 4) + 1
        stats = kv.kv_stats()
        assert stats.num_used_blocks == stats.num_block_refs == len(_live(kv, req)) == 16 - kv.num_free_blocks
        req.num_computed_tokens = n + 1
    assert kv.take_replaced_blocks(req.req_id) == {i: 16 for i in range(max(0, 59 - W + 1) // 4)}
    kv.free(req)
    assert kv.check_no_leaks() == [] and kv.kv_stats().num_block_refs == 0


def test_a_prompt_in_one_chunk_holds_all_its_blocks_for_that_step_only():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=False, sliding_window=W)
    req = make_request(30)
    kv.allocate_slots(req, 30)  # every query of the chunk needs keys from its own window: nothing freed yet
    assert kv.num_live_blocks(req.req_id) == 8
    req.num_computed_tokens = 30
    kv.allocate_slots(req, 1)
    assert kv.num_live_blocks(req.req_id) == 8 - (30 - W + 1) // 4 == 2


def test_prefix_hit_needs_only_the_window_behind_it():
    """A hit is the longest cached prefix whose last W - 1 positions' blocks are still cached, even when
    blocks before them were evicted (they come back as null entries, nobody's reference)."""
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_caching=True, sliding_window=W)
    first = make_request(24, first_token=100)
    for n in range(0, 24, 4):  # chunks of 4: blocks behind the window are freed (still cached) as it goes
        first.num_computed_tokens = n
        kv.allocate_slots(first, 4)
    first.num_computed_tokens = 24
    kv.free(first)
    filler = make_request(16, first_token=900)
    assert kv.allocate_slots(filler, 16) == [6, 7, 0, 1]  # never used, then the first request's oldest
    second = make_request(25, first_token=100)  # the same 24 tokens and one more
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 24 and [b.block_id for b in hits] == [8, 8, 8, 8, 4, 5]  # blocks 0..3 out of the window
    assert kv.allocate_slots(second, 1, hits) == [8, 8, 8, 8, 4, 5, 2]
    assert kv.get_block_ids(second.req_id) == [8, 8, 8, 8, 4, 5, 2] and kv.num_live_blocks(second.req_id) == 3
    third = make_request(25, first_token=100)
    assert kv.get_computed_blocks(third)[1] == 24
    # without a window the same cache has no hit at all: block 0 is gone
    plain = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    plain.pool, plain.req_to_blocks = kv.pool, {}
    assert plain.get_computed_blocks(make_request(25, first_token=100))[1] == 0


def test_fork_shares_null_entries_and_swap_skips_them():
    kv = KVCacheManager(num_blocks=13, block_size=4, enable_caching=False, num_host_blocks=8, sliding_window=W)
    parent, child = make_request(20), make_request(20)
    kv.allocate_slots(parent, 20)
    parent.num_computed_tokens = child.num_computed_tokens = 20
    kv.allocate_slots(parent, 1)
    kv.fork(parent, child)
    assert kv.get_block_ids(child.req_id) == kv.get_block_ids(parent.req_id) == [12, 12, 12, 3, 4, 5]
    assert kv.kv_stats().num_block_refs == 6 and kv.kv_stats().num_used_blocks == 3
    mapping = kv.swap_out(child)
    assert [d for d, _ in mapping] == [3, 4, 5] and kv.host.num_used_blocks == 3
    kv.free(parent)
    assert kv.swap_in(child, 1) is not None
    table = kv.get_block_ids(child.req_id)
    assert table[:3] == [12, 12, 12] and kv.num_live_blocks(child.req_id) == 3
    kv.free(child)
    assert kv.check_no_leaks() == []


class WindowRunner(FakeKVRunner):
    """The fake runner, keeping its own block tables from the step's diffs as the real runner does, and
    checking only the positions a query can still read."""

    def __init__(self, sched, rng, alphabet):
        super().__init__(sched, rng, alphabet)
        self.tables: dict[str, list[int]] = {}

    def execute(self, out):
        kv = self.sched.kv
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
        for cached in out.scheduled_cached_reqs:
            table = self.tables[cached.req_id]
            if cached.num_kept_block_ids is not None:
                del table[cached.num_kept_block_ids:]
            for index, block_id in cached.replaced_block_ids.items():
                table[index] = block_id
            table.extend(cached.new_block_ids)
        null = kv.null_block.block_id
        for req_id, num in out.num_scheduled_tokens.items():
            request = self.sched.requests[req_id]
            assert self.tables[req_id] == kv.get_block_ids(req_id), f"{req_id}: the runner's table drifted"
            start = request.num_computed_tokens - num
            num_dead = max(0, start - W + 1) // BLOCK_SIZE
            assert self.tables[req_id][:num_dead] == [null] * num_dead and null not in self.tables[req_id][num_dead:]
            assert kv.num_live_blocks(req_id) <= cdiv(W - 1 + num, BLOCK_SIZE) + 1
        return super().execute(out)

    def check(self) -> None:
        kv = self.sched.kv
        assert kv.null_block.block_id not in self.device, "the null block was written"
        for request in self.sched.running:
            blocks = kv.req_to_blocks.get(request.req_id, [])
            for pos in range(max(0, request.num_computed_tokens - W + 1), request.num_computed_tokens):
                slot = self.device[blocks[pos // BLOCK_SIZE].block_id][pos % BLOCK_SIZE]
                assert slot == request.all_token_ids[pos], f"{request.req_id}: position {pos} holds {slot}"
        for block in kv.pool.blocks:
            if block.block_hash is not None:
                assert tuple(self.device[block.block_id]) == block.token_ids, f"cached block {block.block_id} is stale"
        stats = kv.kv_stats()
        tables = kv.req_to_blocks.values()
        assert stats.num_block_refs == sum(b.block_id != kv.null_block.block_id for t in tables for b in t)
        assert stats.num_used_blocks == sum(b.ref_cnt > 0 for b in kv.pool.blocks)
        assert sum(stats.blocks_by_priority.values()) == stats.num_block_refs


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24), st.integers(1, 3)),
        st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 1000), st.integers(0, 0), st.integers(0, 0)),
    ),
    max_size=50,
)


@settings(max_examples=120, deadline=None)
@given(ops=operations, num_blocks=st.integers(12, 30), budget=st.integers(1, 40), caching=st.booleans(),
       swap=st.booleans(), k=st.integers(0, 4), seed=st.integers(0, 2**16), alphabet=st.integers(2, 6),
       draft=st.booleans())
def test_window_freeing_with_chunks_prefix_hits_forks_preemption_and_rollbacks(ops, num_blocks, budget, caching,
                                                                            swap, k, seed, alphabet, draft):
    """Random workloads: the runner's tables follow the manager's, the window's positions always hold the
    right tokens, nothing leaks, and the gauges count null entries as nobody's."""
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=200)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, caching, num_host_blocks=12 if swap else 0, sliding_window=W)
    spec_config = None if k == 0 else (
        SpeculativeConfig(method="draft_model", model=DRAFT_DIR, num_speculative_tokens=k) if draft
        else SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3))
    sched = Scheduler(config, kv, "swap" if swap else "recompute", speculative_config=spec_config)
    rng = random.Random(seed)
    runner = WindowRunner(sched, rng, alphabet)

    def step() -> None:
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        _check_block_invariants(sched)
        runner.check()

    for index, (op, x, y, n) in enumerate(ops):
        if op == "add":
            _add(sched, rng, index, x, y, n, alphabet)
        elif op == "step":
            step()
        elif sched.requests:
            live = sorted(sched.requests)
            sched.finish_requests([live[x % len(live)]], RequestStatus.FINISHED_ABORTED)
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests()
    assert kv.check_no_leaks() == []


def test_a_request_longer_than_the_cache_is_admitted_and_runs():
    """Admission refuses by the most blocks a request holds at once, not its whole length."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=400)
    sched = Scheduler(config, KVCacheManager(8, BLOCK_SIZE, False, sliding_window=W))  # 7 usable: 28 tokens
    req = make_request(20, max_tokens=200)
    assert sched.kv.max_blocks_held(220, 8) == cdiv(W - 1 + 8, BLOCK_SIZE) + 1 == 5
    sched.add_request(req)
    plain = Scheduler(config, KVCacheManager(8, BLOCK_SIZE, False))
    with pytest.raises(InvalidRequestError, match="whole cache"):
        plain.add_request(make_request(20, max_tokens=200))
    while sched.has_unfinished_requests():
        run_step(sched)
    assert req.num_output_tokens == 200 and sched.num_preemptions == 0 and sched.kv.check_no_leaks() == []
