"""The Forker on its own: who waits for whom, what a fork looks like, exact block ids and ref counts."""

from pagedllm.core.forking import Forker, kv_block_usage
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus

from .helpers import make_request


def _computed_leader(kv: KVCacheManager, num_prompt_tokens: int, req_id: str = "L"):
    leader = make_request(num_prompt_tokens, req_id=req_id)
    assert kv.allocate_slots(leader, num_prompt_tokens) is not None
    leader.num_computed_tokens = num_prompt_tokens
    leader.status = RequestStatus.RUNNING
    return leader


def test_samples_wait_for_their_leader_then_fork_with_their_own_first_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    forks = Forker(kv)
    leader = _computed_leader(kv, 6)
    s1, s2 = make_request(6, req_id="S1"), make_request(6, req_id="S2")
    forks.add_samples(leader, [s1, s2])
    assert forks.samples_of(leader) == [s1, s2]
    assert forks.is_waiting_sample(s1) and not forks.is_waiting_sample(leader)

    # Only S2 drew a token this step: S1 keeps waiting.
    forked = forks.fork_samples(leader, {"L": [50], "S2": [60]})
    assert forked == [s2] and forks.samples_of(leader) == [s1]
    assert s2.status == RequestStatus.RUNNING and s2.num_computed_tokens == 6
    assert s2.all_token_ids == leader.all_token_ids + [60] and s2.output_token_ids == [60]
    assert kv.get_block_ids("S2") == kv.get_block_ids("L") == [0, 1]
    assert [kv.pool.blocks[b].ref_cnt for b in (0, 1)] == [2, 2]
    assert forks.take_unsent("S2") and not forks.take_unsent("S2")  # the runner hears of it once
    assert not forks.take_unsent("L")

    forks.fork_samples(leader, {"S1": [70]})
    assert forks.samples_of(leader) == [] and not forks.is_waiting_sample(s1)
    assert [kv.pool.blocks[b].ref_cnt for b in (0, 1)] == [3, 3]
    assert kv_block_usage(kv, ["L", "S1", "S2"]) == (2, 6)


def test_forgetting_a_leader_hands_back_its_samples_which_forget_cleanly():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    forks = Forker(kv)
    leader = make_request(6, req_id="L")
    s1, s2 = make_request(6, req_id="S1"), make_request(6, req_id="S2")
    forks.add_samples(leader, [s1, s2])
    assert forks.forget(s1) == [] and forks.samples_of(leader) == [s2]  # a sample aborted alone
    assert forks.forget(leader) == [s2]  # it can never start now: the caller finishes it
    assert forks.is_waiting_sample(s2)  # still in neither queue until the caller finishes it
    assert forks.forget(s2) == [] and not forks.is_waiting_sample(s2)
    assert forks.samples_of(leader) == []


def test_a_beam_fork_replaces_the_last_token_and_shares_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    forks = Forker(kv)
    parent = _computed_leader(kv, 5, req_id="P")
    parent.append_output_token(40)  # sampled, not computed yet
    child = forks.fork(parent, "C", last_token_id=41)
    assert child.req_id == "C" and child.status == RequestStatus.RUNNING
    assert child.all_token_ids == parent.all_token_ids[:-1] + [41] and child.output_token_ids == [41]
    assert child.num_computed_tokens == 5 and child.eos_token_ids == parent.eos_token_ids
    assert kv.get_block_ids("C") == kv.get_block_ids("P") == [0, 1]
    assert forks.take_unsent("C")
    # The first writer into the shared partial block copies it; full block 0 stays shared.
    child.num_computed_tokens = 5
    assert kv.allocate_slots(child, 1) == []
    assert kv.take_block_copies() == [(1, 2)] and kv.get_block_ids("C") == [0, 2]
    assert kv_block_usage(kv, ["P", "C"]) == (3, 4)


def test_a_beam_candidate_keeps_its_parents_rank():
    """Under 'priority' a beam group is ranked by its request: a forked candidate keeps the parent's
    priority and arrival time (it once came out with priority 0, outranking its own group)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _computed_leader(kv, 5, req_id="P")
    parent.priority = 3
    parent.append_output_token(9)  # sampled, not computed
    child = Forker(kv).fork(parent, "C", last_token_id=11)
    assert (child.priority, child.arrival_time) == (parent.priority, parent.arrival_time)
    assert child.all_token_ids == parent.all_token_ids[:-1] + [11] and child.num_computed_tokens == 5
