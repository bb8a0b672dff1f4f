"""Beam groups in the core, with no model: token counts that never let half a group sample, children
that take their parents' place, and groups preempted and readmitted whole with the same result."""

from __future__ import annotations

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.beam_gang import beam_group_token_counts
from pagedllm.core.beam_registry import BeamGroups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, TokenLogprobs
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams

from .helpers import EOS, make_request


@pytest.mark.parametrize("remaining, budget, admitting, expected", [
    ([1, 1, 1], 3, False, [1, 1, 1]),       # a decode step: every beam samples
    ([1, 1, 1], 2, False, None),            # not all can sample, and none may compute less than 1
    ([9, 9], 20, True, [9, 9]),             # a recomputed group that fits: all reach their end
    ([9, 9], 10, False, [8, 2]),            # chunks stop one token short of the end
    ([9, 9], 10, True, [8, 2]),
    ([9, 9], 1, True, None),                # admitting: each beam needs at least one token
    ([9, 9], 3, True, [2, 1]),
    ([1, 9], 5, True, None),                # a beam one token from its end would sample alone
    ([1, 9], 5, False, [0, 5]),             # running: that beam just waits
])
def test_beam_group_token_counts(remaining, budget, admitting, expected):
    assert beam_group_token_counts(remaining, budget, admitting) == expected


def _beam_request(req_id: str, prompt: list[int], width: int, max_tokens: int, n: int | None = None,
                  **params) -> EngineCoreRequest:
    sp = SamplingParams(n=n or width, best_of=width, temperature=0, max_tokens=max_tokens,
                        use_beam_search=True, **params)
    return EngineCoreRequest(req_id, prompt, sp, [EOS], max_tokens)


def _fake_runner(sched: Scheduler, out, vocab=range(2, 40)) -> ModelRunnerOutput:
    """Deterministic 'logprobs' from each row's whole history, so a preempted and recomputed beam
    sees what it saw before; the sampled token is the most likely one, as greedy rows do."""
    sampled, logprobs = {}, {}
    for req_id in out.num_scheduled_tokens:
        request = sched.requests[req_id]
        if request.num_computed_tokens != request.num_tokens:
            continue
        rng = random.Random(hash(tuple(request.all_token_ids)))
        k = request.sampling_params.logprobs or 0
        tokens = rng.sample(list(vocab), k + 1)
        values = sorted((-rng.uniform(0.1, 5.0) for _ in tokens), reverse=True)
        sampled[req_id] = [tokens[0]]
        logprobs[req_id] = [TokenLogprobs([tokens[0]] + tokens[: k], [values[0]] + values[: k], 1)]
    return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _groups(sched: Scheduler) -> BeamGroups:
    return BeamGroups(sched.config, sched.kv.num_blocks, sched.kv.num_blocks_for_tokens)


def _update(sched: Scheduler, groups: BeamGroups, out, runner_output) -> list:
    """One step's update as EngineCore._step_beam_groups makes it: the groups decide, the scheduler
    forks the children and finishes the parents."""
    outputs, steps = groups.update(sched.update_from_output(out, runner_output))
    for step in steps:
        if step.children:
            sched.replace_beams(step.parent_ids, step.children)
        else:
            sched.finish_requests(step.parent_ids, RequestStatus.FINISHED_ABORTED)
    return outputs


def _add(sched: Scheduler, groups: BeamGroups, request: EngineCoreRequest) -> None:
    sched.add_request(groups.add(request))


def _run(num_blocks: int, preemption_mode: str = "recompute", max_num_batched_tokens: int = 64, check=None,
         policy: str = "fcfs", priorities: dict[str, int] | None = None):
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=128,
                             scheduling_policy=policy)
    kv = KVCacheManager(num_blocks, 4, enable_caching=False, num_host_blocks=256)
    sched = Scheduler(config, kv, preemption_mode)
    groups = _groups(sched)
    requests = [make_request(6, max_tokens=16, req_id="A", ignore_eos=True),
                _beam_request("G", [50, 51, 52, 53, 54], width=3, max_tokens=8),
                make_request(5, max_tokens=16, req_id="B", ignore_eos=True),
                _beam_request("H", [60, 61, 62], width=2, max_tokens=10, n=1, length_penalty=0.0)]
    for request in requests:
        request.priority = (priorities or {}).get(request.req_id, 0)
        if request.sampling_params.use_beam_search:
            _add(sched, groups, request)
        else:
            sched.add_request(request)
    results = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if check is not None:
            check(sched, groups, out)
        for o in _update(sched, groups, out, _fake_runner(sched, out)):
            results.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert kv.check_no_leaks() == []
    return sched, results


def test_children_take_their_parents_place_and_keep_the_group_side_by_side():
    seen = []

    def check(sched, groups, out):
        for group in groups.groups.values():
            beams = [sched.requests[r] for r in group.beam_req_ids]
            if beams[0].status == RequestStatus.RUNNING:
                positions = [sched.running.index(b) for b in beams]
                assert positions == list(range(positions[0], positions[0] + len(beams)))
                seen.append(len(beams))
        # the oldest stays first: A, then G's beams, then B, then H's
        order = [r.beam_group_id or r.req_id for r in sched.running]
        assert order == sorted(order, key=["A", "G", "B", "H"].index)

    sched, results = _run(num_blocks=256, check=check)
    assert max(seen) == 3 and sched.num_beam_group_preemptions == 0
    assert set(results) == {"A", "B", "G#0", "G#1", "G#2", "H"}
    for beam in ("G#0", "G#1", "G#2"):  # each beam ends with EOS or at max_tokens
        assert len(results[beam]) == 8 or (results[beam][-1] == EOS and len(results[beam]) < 8)


@pytest.mark.parametrize("mode, budget", [("recompute", 64), ("recompute", 7), ("swap", 64)])
def test_groups_preempted_whole_under_pressure_end_as_without_it(mode, budget):
    def check(sched, groups, out):
        for group in groups.groups.values():
            statuses = {sched.requests[r].status for r in group.beam_req_ids}
            assert len(statuses) == 1, statuses
            scheduled = {r in out.num_scheduled_tokens for r in group.beam_req_ids}
            assert len(scheduled) == 1, "half a group was scheduled"

    _, expected = _run(num_blocks=256)
    sched, results = _run(num_blocks=14, preemption_mode=mode, max_num_batched_tokens=budget, check=check)
    assert sched.num_beam_group_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_outs > 0
    assert results == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_preempts_and_readmits_groups_whole(mode):
    """Under 'priority' a group is ranked by its request's priority: the worst-ranked group is the victim
    (all its beams), a better-ranked blocked group preempts it, and the beams return side by side."""
    priorities = {"A": 2, "G": 1, "B": 0, "H": -1}

    def check(sched, groups, out):
        for group in groups.groups.values():
            beams = [sched.requests[r] for r in group.beam_req_ids]
            assert len({b.status for b in beams}) == 1
            assert len({r in out.num_scheduled_tokens for r in group.beam_req_ids}) == 1, "half a group was scheduled"
            queue = sched.running if beams[0].status == RequestStatus.RUNNING else list(sched.waiting)
            positions = [queue.index(b) for b in beams]
            assert positions == list(range(positions[0], positions[0] + len(beams)))

    _, expected = _run(num_blocks=256, policy="priority", priorities=priorities)
    sched, results = _run(num_blocks=14, preemption_mode=mode, check=check, policy="priority",
                          priorities=priorities)
    assert sched.num_beam_group_preemptions > 0
    assert results == expected


def test_a_group_that_could_never_fit_is_refused():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    groups = _groups(Scheduler(config, KVCacheManager(10, 4, enable_caching=False)))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        groups.add(_beam_request("G", [5] * 8, width=3, max_tokens=8))  # 3 x 4 blocks > 10
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        groups.add(_beam_request("H", [5], width=5, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="logprobs"):
        groups.add(EngineCoreRequest("E", [5], SamplingParams(n=6, temperature=0, max_tokens=2, use_beam_search=True),
                                     [1, 2, 3], 2))  # 6 beams x (1 + 3 EOS ids) candidates > 20
    assert not groups.groups


def _started_group(width: int = 2):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config, KVCacheManager(32, 4, enable_caching=False))
    groups = _groups(sched)
    _add(sched, groups, _beam_request("G", [5, 6, 7, 8, 9], width=width, max_tokens=6))
    out = sched.schedule()
    assert _update(sched, groups, out, _fake_runner(sched, out)) == []
    return sched, groups


def test_an_abort_under_any_sequence_id_ends_the_whole_group():
    sched, groups = _started_group(width=3)
    beam_ids = list(groups.groups["G"].beam_req_ids)
    assert len(beam_ids) == 3 and all(sched.requests[b].status == RequestStatus.RUNNING for b in beam_ids)
    others, beams = groups.abort(["G#1", "other"])
    assert others == ["other"] and beams == beam_ids
    assert not groups.groups and groups.num_beams_running == 0
    assert all(sched.requests[b].status == RequestStatus.RUNNING for b in beam_ids)  # the registry only decides
    sched.finish_requests(beams, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.kv.check_no_leaks() == []


def test_a_failed_beam_fails_its_group_and_frees_the_others():
    sched, groups = _started_group(width=2)
    out = sched.schedule()
    failing = groups.groups["G"].beam_req_ids[0]
    runner = _fake_runner(sched, out)
    del runner.sampled_token_ids[failing], runner.logprobs[failing]
    runner.failed[failing] = "boom"
    outputs = _update(sched, groups, out, runner)
    assert [(o.req_id, o.finish_reason, o.error) for o in outputs] == [("G#0", "abort", "boom"), ("G#1", "abort", "boom")]
    assert not groups.groups and not sched.has_unfinished_requests() and sched.kv.check_no_leaks() == []
