"""What the sequences of one request have in common is built once and shared, never copied or
re-validated per sequence, nor rebuilt per step."""

from __future__ import annotations

from pagedllm.core.request import EngineCoreRequest, Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

from .helpers import make_scheduler, sample_for


def _request(n: int, **params) -> EngineCoreRequest:
    return EngineCoreRequest("r", [5, 6, 7], SamplingParams(n=n, max_tokens=4, **params), [2], 4)


def test_sequences_share_the_stop_set_and_the_params_containers(monkeypatch):
    stop_ids = list(range(10, 5000))
    bias = {t: 1.0 for t in range(300)}
    req = _request(64, stop_token_ids=stop_ids, logit_bias=bias, seed=3)
    validations = []
    monkeypatch.setattr(SamplingParams, "_validate", lambda self: validations.append(self))
    sequences = Request.for_sequences(req)
    assert validations == []  # the params were validated once, when the user built them
    first = sequences[0]
    assert isinstance(first.stop_token_id_set, frozenset) and first.stop_token_id_set == frozenset(stop_ids)
    for seq in sequences:
        assert seq.stop_token_id_set is first.stop_token_id_set
        assert seq.sampling_params.stop_token_ids is req.sampling_params.stop_token_ids
        assert seq.sampling_params.logit_bias is bias
        assert seq.prompt_token_ids is first.prompt_token_ids and seq.eos_token_ids is first.eos_token_ids
    # what differs per sequence still differs
    assert [s.sampling_params.seed for s in sequences[:3]] == [3, 4, 5]
    assert all(s.sampling_params.n == 1 and s.sampling_params.best_of is None for s in sequences)
    assert req.sampling_params.n == 64  # the user's params are untouched


def test_best_of_sequences_compute_logprobs_without_touching_the_original():
    req = _request(2, best_of=4)
    sequences = Request.for_sequences(req)
    assert [s.sampling_params.logprobs for s in sequences] == [0] * 4
    assert req.sampling_params.logprobs is None


def test_the_stop_check_uses_the_shared_set_and_beam_forks_share_it():
    sched = make_scheduler()
    req = Request.for_sequences(EngineCoreRequest("a", [100, 101], SamplingParams(max_tokens=10, stop_token_ids=[9, 8]),
                                                  [2], 10))[0]
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, sample_for(sched, out, token_id=5))
    child = sched.fork_request("a", "a.1", 6)
    assert child.stop_token_id_set is req.stop_token_id_set
    out = sched.schedule()
    outputs = sched.update_from_output(out, sample_for(sched, out, token_id=8))
    assert {o.req_id: (o.finish_reason, o.stop_reason) for o in outputs} == {"a": ("stop", 8), "a.1": ("stop", 8)}
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_a_directly_built_request_derives_its_stop_set():
    req = Request("x", [1, 2], SamplingParams(stop_token_ids=[4, 4, 7]), frozenset({2}), 4)
    assert req.stop_token_id_set == frozenset({4, 7})
