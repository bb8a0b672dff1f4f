"""Copy-on-write, forks and parallel sampling in the core, with exact block ids and ref counts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput

from .helpers import make_request, make_scheduler, sample_for


def _ref_cnts(sched, block_ids):
    return [sched.kv.pool.blocks[b].ref_cnt for b in block_ids]


def _sample_with_forks(sched, out, tokens):
    """Runner stand-in: every sampling request samples; a leader's pending samples sample too."""
    runner_out = sample_for(sched, out)
    for req_id in list(runner_out.sampled_token_ids):
        request = sched.requests[req_id]
        runner_out.sampled_token_ids[req_id] = [tokens.get(req_id, 7)]
        for child in sched.forks.samples_of(request):
            runner_out.sampled_token_ids[child.req_id] = [tokens.get(child.req_id, 8)]
    return runner_out


def test_worked_example_first_writer_copies_second_writes_in_place():
    # Two samples of an 11-token prompt, block size 4: two full blocks and a partial one (3 of 4).
    sched = make_scheduler(num_blocks=8, block_size=4)
    a1 = make_request(11, max_tokens=5, req_id="A1")
    a2 = make_request(11, max_tokens=5, req_id="A2")
    sched.add_request(a1, parallel_samples=[a2])
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A1": 11}  # the prompt is computed once
    assert out.scheduled_new_reqs[0].fork_children == [("A2", a2.sampling_params)]
    sched.update_from_output(out, _sample_with_forks(sched, out, {"A1": 50, "A2": 60}))
    # After the fork both tables point at the same three blocks, each with ref count 2.
    assert sched.kv.get_block_ids("A1") == sched.kv.get_block_ids("A2") == [0, 1, 2]
    assert _ref_cnts(sched, [0, 1, 2]) == [2, 2, 2]
    assert a1.all_token_ids[-1] == 50 and a2.all_token_ids[-1] == 60

    out = sched.schedule()  # both write position 11, in the shared partial block 2
    assert out.num_scheduled_tokens == {"A1": 1, "A2": 1}
    assert out.block_copies == [(2, 3)]  # A1 writes first: it copies; A2 is then the last sharer
    assert sched.kv.get_block_ids("A1") == [0, 1, 3]
    assert sched.kv.get_block_ids("A2") == [0, 1, 2]  # writes in place, no copy
    assert _ref_cnts(sched, [0, 1, 2, 3]) == [2, 2, 1, 1]  # full blocks are never copied
    (cached_a1,) = out.scheduled_cached_reqs
    assert cached_a1.req_id == "A1" and cached_a1.replaced_block_ids == {2: 3}
    (new_a2,) = out.scheduled_new_reqs  # the runner learns the forked sample once, whole
    assert new_a2.req_id == "A2" and new_a2.block_ids == [0, 1, 2] and new_a2.num_computed_tokens == 11
    assert new_a2.token_ids == a1.prompt_token_ids + [60]
    assert sched.kv.num_cow_copies == 1


def test_fork_at_a_block_boundary_copies_nothing():
    sched = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_request(8, req_id="a"), make_request(8, req_id="b")
    sched.add_request(a, parallel_samples=[b])
    out = sched.schedule()
    sched.update_from_output(out, _sample_with_forks(sched, out, {}))
    out = sched.schedule()
    assert out.block_copies == []
    assert sched.kv.get_block_ids("a") == [0, 1, 2] and sched.kv.get_block_ids("b") == [0, 1, 3]


def test_fork_and_prune_release_every_block_exactly_once():
    sched = make_scheduler(num_blocks=8, block_size=4)
    leader = make_request(6, max_tokens=20, req_id="L")
    samples = [make_request(6, max_tokens=20, req_id=f"S{i}") for i in range(3)]
    sched.add_request(leader, parallel_samples=samples)
    out = sched.schedule()
    sched.update_from_output(out, _sample_with_forks(sched, out, {}))
    assert _ref_cnts(sched, [0, 1]) == [4, 4]
    sched.finish_requests(["S0", "S2"], RequestStatus.FINISHED_ABORTED)  # pruned
    assert _ref_cnts(sched, [0, 1]) == [2, 2]
    sched.finish_requests(["L", "S1"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.check_no_leaks() == []


def test_aborting_a_leader_before_its_prompt_finishes_aborts_its_samples():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    leader, sample = make_request(10, req_id="L"), make_request(10, req_id="S")
    sched.add_request(leader, parallel_samples=[sample])
    sched.update_from_output(out := sched.schedule(), sample_for(sched, out))  # a chunk of the prompt
    finished = sched.finish_requests(["L"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in finished] == ["L", "S"]
    assert not sched.has_unfinished_requests() and sched.kv.check_no_leaks() == []


def test_beam_fork_replaces_the_last_token_and_shares_all_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4)
    parent = make_request(6, max_tokens=10, req_id="p")
    sched.add_request(parent)
    out = sched.schedule()
    sched.update_from_output(out, sample_for(sched, out, token_id=40))
    child = sched.fork_request("p", "c", last_token_id=41)
    assert child.req_id == "c" and sched.requests["c"] is child
    assert child.max_tokens == parent.max_tokens and child.sampling_params is parent.sampling_params
    assert child.all_token_ids == parent.all_token_ids[:-1] + [41]
    assert child.num_computed_tokens == 6 and child.num_tokens == 7
    assert sched.kv.get_block_ids("c") == [0, 1] and _ref_cnts(sched, [0, 1]) == [2, 2]
    sched.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)  # the parent is pruned
    assert _ref_cnts(sched, [0, 1]) == [1, 1]
    out = sched.schedule()
    assert out.block_copies == []  # the last sharer writes in place
    assert out.scheduled_new_reqs[0].token_ids == child.all_token_ids


def test_lru_eviction_order_and_tail_first_free():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    a, b = make_request(6, req_id="a", first_token=100), make_request(4, req_id="b", first_token=300)
    kv.allocate_slots(a, 6)  # blocks 0, 1, 2
    kv.allocate_slots(b, 4)  # blocks 3, 4
    kv.free(b)
    kv.free(a)
    # b was freed first, tail first; then a, tail first. Never-used block 5 leads.
    assert kv.pool.free_queue.block_ids() == [5, 4, 3, 2, 1, 0]
    c = make_request(4, req_id="c", first_token=900)
    assert kv.allocate_slots(c, 4) == [5, 4]  # evicts b's tail before b's head
    hits, _ = kv.get_computed_blocks(make_request(5, req_id="a2", first_token=100))
    assert [blk.block_id for blk in hits] == [0, 1]  # a's prefix still cached
    assert kv.pool.num_evictions == 1  # only block 4 held cached content (b's first block is 3)


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    first = make_request(9, req_id="x")
    first.cache_salt = "tenant-1"
    kv.allocate_slots(first, 9)
    same_salt = make_request(9, req_id="y")
    same_salt.cache_salt = "tenant-1"
    other_salt = make_request(9, req_id="z")
    other_salt.cache_salt = "tenant-2"
    no_salt = make_request(9, req_id="w")
    assert kv.get_computed_blocks(same_salt)[1] == 8
    assert kv.get_computed_blocks(other_salt)[1] == 0
    assert kv.get_computed_blocks(no_salt)[1] == 0


# --- property: random fork / append / free / cache-hit / evict sequences ---------------------

def _check_invariants(kv: KVCacheManager, live: dict):
    owners = {}
    for req_id, blocks in kv.req_to_blocks.items():
        for block in blocks:
            owners[block.block_id] = owners.get(block.block_id, 0) + 1
    free_ids = set(kv.pool.free_queue.block_ids())
    for block in kv.pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == owners.get(block.block_id, 0)
        in_free = block.block_id in free_ids
        assert in_free == (block.ref_cnt == 0)  # free (maybe cached) or owned, never both
        if block.block_hash is not None:
            assert kv.pool.cached_blocks.get(block.block_hash) is block
    for req_id, request in live.items():
        assert len(kv.req_to_blocks.get(req_id, [])) == kv.num_blocks_for_tokens(request.num_computed_tokens)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 10**6)), max_size=50),
    num_blocks=st.integers(4, 16),
)
def test_random_fork_append_free_sequences_keep_ref_counts_exact(ops, num_blocks):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=2, enable_caching=True)
    live = {}
    counter = 0
    for op, x in ops:
        counter += 1
        if op == "new":
            request = make_request(1 + x % 7, req_id=f"n{counter}", first_token=100 + x % 2)
            hits, num_hit = kv.get_computed_blocks(request)  # cache hits when prompts repeat
            num_new = request.num_tokens - num_hit
            if kv.allocate_slots(request, num_new, hits) is not None:
                request.num_computed_tokens = request.num_tokens
                live[request.req_id] = request
        elif live and op == "append":
            request = live[sorted(live)[x % len(live)]]
            request.append_output_token(x % 5)
            if kv.allocate_slots(request, 1) is not None:
                request.num_computed_tokens += 1
            else:
                request.all_token_ids.pop()
                request.output_token_ids.pop()
        elif live and op == "fork":
            parent = live[sorted(live)[x % len(live)]]
            child = make_request(1, req_id=f"f{counter}")
            child.all_token_ids = list(parent.all_token_ids)
            child.prompt_token_ids = list(parent.prompt_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child)
            live[child.req_id] = child
        elif live and op == "free":
            request = live.pop(sorted(live)[x % len(live)])
            kv.free(request)
        kv.take_block_copies()
        _check_invariants(kv, live)
    for request in list(live.values()):
        kv.free(request)
    assert kv.check_no_leaks() == []
