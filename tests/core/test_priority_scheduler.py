"""The 'priority' scheduling policy with exact expectations: who is admitted, who is preempted and when it
resumes; and that 'fcfs' ignores priorities altogether.

Block arithmetic used below (block_size 4): admission keeps HEADROOM_BLOCKS_PER_SEQ (2) free blocks per
running sequence, capped at a quarter of the cache (2 blocks for an 8-block cache).
"""

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import RequestStatus
from pagedllm.core.request_queue import PriorityQueue, priority_rank
from pagedllm.core.scheduler import Scheduler

from .helpers import make_request, step


def make_scheduler(policy: str, num_blocks: int = 8, max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                   enable_caching: bool = False, preemption_mode: str = "recompute") -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=256, scheduling_policy=policy)
    num_host_blocks = num_blocks if preemption_mode == "swap" else 0
    return Scheduler(config, KVCacheManager(num_blocks, 4, enable_caching, num_host_blocks), preemption_mode)


def make(req_id: str, num_prompt_tokens: int, priority: int, max_tokens: int = 8, arrival_time: float | None = None,
         first_token: int = 100):
    request = make_request(num_prompt_tokens, max_tokens, req_id=req_id, first_token=first_token)
    request.priority = priority
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def admission_order(sched: Scheduler, max_steps: int = 100) -> list[str]:
    """Request ids in the order the scheduler first admitted them, running the queue dry."""
    order = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return order
        out, _ = step(sched)
        order += [r.req_id for r in out.scheduled_new_reqs if r.req_id not in order]
    raise AssertionError("the scheduler did not finish")


# --- the waiting queue ---------------------------------------------------------------------


def test_priority_queue_orders_by_priority_then_arrival_then_entry():
    queue = PriorityQueue()
    reqs = {name: make(name, 2, prio, arrival_time=t) for name, prio, t in
            [("late-urgent", 0, 5.0), ("early-lazy", 3, 1.0), ("mid", 1, 2.0), ("mid-earlier", 1, 1.5),
             ("twin-a", 2, 3.0), ("twin-b", 2, 3.0)]}
    for r in reqs.values():
        queue.append(r)
    expected = ["late-urgent", "mid-earlier", "mid", "twin-a", "twin-b", "early-lazy"]
    assert [r.req_id for r in queue] == expected
    assert queue[0].req_id == "late-urgent" and queue[3].req_id == "twin-a"
    queue.remove(reqs["mid"])
    assert len(queue) == 5
    assert [queue.popleft().req_id for _ in range(5)] == ["late-urgent", "mid-earlier", "twin-a", "twin-b",
                                                           "early-lazy"]


def test_priority_admits_lowest_value_first_and_ties_by_arrival():
    sched = make_scheduler("priority", num_blocks=64, max_num_seqs=1)
    # d arrives (by its arrival time) before c though it is queued after it: arrival decides the tie.
    for name, prio, t in [("a", 5, 1.0), ("b", 9, 2.0), ("c", 1, 4.0), ("d", 1, 3.0), ("e", -2, 5.0)]:
        sched.add_request(make(name, 3, prio, max_tokens=2, arrival_time=t))
    assert admission_order(sched) == ["e", "d", "c", "a", "b"]


def test_fcfs_ignores_priority():
    sched = make_scheduler("fcfs", num_blocks=64, max_num_seqs=1)
    for name, prio in [("a", 5), ("b", 9), ("c", 1), ("d", -2)]:
        sched.add_request(make(name, 3, prio, max_tokens=2))
    assert admission_order(sched) == ["a", "b", "c", "d"]


def test_a_new_arrival_is_admitted_ahead_of_an_older_waiting_request_it_outranks():
    sched = make_scheduler("priority", num_blocks=64, max_num_seqs=1)
    sched.add_request(make("running", 3, 5, max_tokens=3))
    step(sched)
    sched.add_request(make("old-lazy", 3, 5, max_tokens=2))
    sched.add_request(make("new-urgent", 3, 0, max_tokens=2))
    assert [r.req_id for r in sched.waiting] == ["new-urgent", "old-lazy"]
    assert admission_order(sched) == ["new-urgent", "old-lazy"]


# --- preemption when running requests run out of blocks ----------------------------------------


def _three_requests_that_outgrow_the_cache(policy: str) -> tuple[Scheduler, list]:
    """a (priority 2) runs first, then b (0) and c (1) join: three 4-token prompts in 8 blocks. In step 7
    every request needs its third block with two free, so the allocation fails for whichever runs last."""
    sched = make_scheduler(policy, num_blocks=8)
    sched.add_request(make("a", 4, 2, max_tokens=20))
    outs = [step(sched)[0]]
    sched.add_request(make("b", 4, 0, max_tokens=8))
    sched.add_request(make("c", 4, 1, max_tokens=20))
    return sched, outs + [step(sched)[0] for _ in range(9)]


def test_priority_preempts_the_worst_ranked_running_request_and_resumes_it_when_blocks_free():
    sched, outs = _three_requests_that_outgrow_the_cache("priority")
    assert [r.req_id for r in outs[1].scheduled_new_reqs] == ["b", "c"]
    # From step 3 on the running requests are served best rank first.
    assert list(outs[2].num_scheduled_tokens) == ["b", "c", "a"]
    assert [o.preempted_req_ids for o in outs[:6]] == [set()] * 6
    # Step 7: a (priority 2) is preempted though it was admitted first; b and c decode.
    assert outs[6].preempted_req_ids == {"a"}
    assert outs[6].num_scheduled_tokens == {"b": 1, "c": 1}
    # b finishes (8 tokens) in step 9, freeing 3 blocks: a resumes in step 10, recomputing 4 + 6 tokens.
    assert outs[7].num_scheduled_tokens == outs[8].num_scheduled_tokens == {"b": 1, "c": 1}
    assert sched.requests.get("b") is None
    assert outs[9].num_scheduled_tokens == {"c": 1, "a": 10}
    assert [r.req_id for r in outs[9].scheduled_new_reqs] == ["a"]


def test_fcfs_preempts_the_newest_running_request_as_before():
    sched, outs = _three_requests_that_outgrow_the_cache("fcfs")
    assert list(outs[2].num_scheduled_tokens) == ["a", "b", "c"]
    assert outs[6].preempted_req_ids == {"c"}
    assert outs[6].num_scheduled_tokens == {"a": 1, "b": 1}
    # c (4 + 5 tokens: 3 blocks + 2 headroom) does not fit in the 3 blocks b leaves.
    assert outs[9].num_scheduled_tokens == {"a": 1}


def test_a_preempted_request_returns_to_its_rank_in_the_waiting_queue():
    sched = make_scheduler("priority", num_blocks=8)
    sched.add_request(make("a", 4, 2, max_tokens=20, arrival_time=10.0))
    sched.add_request(make("b", 4, 0, max_tokens=20, arrival_time=11.0))
    sched.add_request(make("c", 4, 1, max_tokens=20, arrival_time=12.0))
    for _ in range(5):
        step(sched)
    # Queued while the three run: one outranks a, one ties with it but arrived later, one ranks below.
    for name, prio, t in [("tie-later", 2, 20.0), ("better", 1, 21.0), ("worse", 3, 22.0)]:
        sched.add_request(make(name, 4, prio, arrival_time=t))
    out, _ = step(sched)
    assert out.preempted_req_ids == {"a"}
    assert [r.req_id for r in sched.waiting] == ["better", "a", "tie-later", "worse"]
    assert sched.requests["a"].status == RequestStatus.PREEMPTED


# --- a waiting request preempting a running one ------------------------------------------------


def _two_long_runners_then_urgent(policy: str, urgent_priority: int = 0, urgent_arrival: float = 3.0):
    """l1 and l2 (12-token prompts, priority 5) fill all 8 blocks by step 2; then `h` (8 tokens) arrives."""
    sched = make_scheduler(policy, num_blocks=8)
    sched.add_request(make("l1", 12, 5, max_tokens=10, arrival_time=1.0))
    sched.add_request(make("l2", 12, 5, max_tokens=10, arrival_time=2.0))
    step(sched)
    sched.add_request(make("h", 8, urgent_priority, max_tokens=3, arrival_time=urgent_arrival))
    return sched, [step(sched)[0] for _ in range(10)]  # steps 2..11


def test_a_blocked_high_priority_request_preempts_the_worst_running_one_next_step():
    sched, outs = _two_long_runners_then_urgent("priority")
    # Step 2: no free block for h (each runner holds 4): h is blocked, nothing preempted yet.
    assert outs[0].num_scheduled_tokens == {"l1": 1, "l2": 1} and outs[0].preempted_req_ids == set()
    # Step 3: l2 (the newer of the two priority-5 runners) is preempted for h, which runs at once.
    assert outs[1].preempted_req_ids == {"l2"}
    assert outs[1].num_scheduled_tokens == {"l1": 1, "h": 8}
    # h finishes in step 5; l2 (12 + 2 tokens: 4 blocks + 2 headroom) fits only once l1 ends (step 10).
    assert outs[3].num_scheduled_tokens == {"h": 1, "l1": 1}
    assert [o.num_scheduled_tokens for o in outs[4:8]] == [{"l1": 1}] * 4
    assert outs[9].num_scheduled_tokens == {"l2": 14}
    assert sched.requests["l2"].num_preemptions == 1


def test_fcfs_never_preempts_for_a_waiting_request():
    sched, outs = _two_long_runners_then_urgent("fcfs")
    assert all(o.num_scheduled_tokens == {"l1": 1, "l2": 1} for o in outs[:4])
    assert outs[4].preempted_req_ids == {"l2"}  # pressure alone, at position 16
    assert "h" not in {r.req_id for o in outs for r in o.scheduled_new_reqs}  # l2 goes back ahead of it


@pytest.mark.parametrize("urgent_priority,urgent_arrival", [(5, 3.0), (5, 2.0), (9, 0.0)])
def test_a_blocked_request_that_does_not_outrank_preempts_nothing(urgent_priority, urgent_arrival):
    # (5, 2.0) ties with l2's rank exactly: preempting an equal would only trade places
    sched, outs = _two_long_runners_then_urgent("priority", urgent_priority, urgent_arrival)
    assert all(o.num_scheduled_tokens == {"l1": 1, "l2": 1} for o in outs[:4])
    assert all(o.preempted_req_ids == set() for o in outs[:4])


def test_one_victim_per_step_until_the_blocked_head_fits():
    sched = make_scheduler("priority", num_blocks=16)  # headroom cap: 4 blocks
    for i in range(4):
        sched.add_request(make(f"l{i}", 8, 5 + i, max_tokens=30, arrival_time=float(i)))
    step(sched)  # 4 x 2 blocks + position 8 in step 2 -> 4 x 3 = 12 held
    step(sched)
    assert sched.kv.pool.num_free_blocks == 4
    sched.add_request(make("h", 16, 0, max_tokens=2, arrival_time=10.0))
    outs = [step(sched)[0] for _ in range(4)]
    assert outs[0].preempted_req_ids == set()  # blocked: needs 4 + 4 headroom, 4 free
    assert outs[1].preempted_req_ids == {"l3"}  # worst rank first; 7 free < 4 + 4 (3 running)
    assert outs[2].preempted_req_ids == {"l2"}  # 10 free >= 4 + 4: h is admitted
    assert outs[2].num_scheduled_tokens == {"l0": 1, "l1": 1, "h": 16}
    assert outs[3].preempted_req_ids == set()


# --- no leaks with prefix caching, chunked prefill and preemption --------------------------------


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_priority_with_prefix_caching_and_chunked_prefill_frees_every_block(seed, preemption_mode):
    rng = random.Random(seed)
    num_blocks = 24
    sched = make_scheduler("priority", num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=10,
                           enable_caching=True, preemption_mode=preemption_mode)
    prefixes = [[500 + i for i in range(9)], [700 + i for i in range(6)]]
    pending = []
    for i in range(18):
        prompt = rng.choice(prefixes) + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 14))]
        request = make(f"r{i}", len(prompt), rng.randrange(0, 4), max_tokens=rng.randrange(2, 14))
        request.prompt_token_ids[:] = prompt
        request.all_token_ids[:] = prompt
        pending.append((rng.randrange(0, 30), request))
    finished, preempted, step_no = set(), 0, 0
    by_id = {r.req_id: r for _, r in pending}
    while pending or sched.has_unfinished_requests():
        for arrival in [p for p in pending if p[0] <= step_no]:
            pending.remove(arrival)
            sched.add_request(arrival[1])
        out, outputs = step(sched, token_id=rng.randrange(3, 50))
        preempted += len(out.preempted_req_ids)
        # nothing admitted this step is outranked by a request left waiting
        if sched.waiting and out.scheduled_new_reqs:
            worst_admitted = max(priority_rank(by_id[r.req_id]) for r in out.scheduled_new_reqs)
            assert worst_admitted <= priority_rank(sched.waiting[0])
        finished |= {o.req_id for o in outputs if o.finished}
        step_no += 1
        assert step_no < 2000
    assert len(finished) == 18 and preempted > 0
    assert sched.kv.check_no_leaks() == []
    assert sched.kv.pool.num_free_blocks == num_blocks


def test_every_sequence_of_a_request_carries_its_priority():
    from pagedllm.core.request import EngineCoreRequest, Request
    from pagedllm.sampling_params import SamplingParams

    req = EngineCoreRequest("r", [5, 6, 7], SamplingParams(n=3, max_tokens=4), [2], 4, priority=-4)
    assert [s.priority for s in Request.for_sequences(req)] == [-4, -4, -4]
