"""Pooling requests in the scheduler: prompt chunks, one pooled output, blocks freed at once, prefix
hits only where the pooler reads the last position alone."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

from .helpers import make_request, make_scheduler, step


def make_pooling_request(num_prompt_tokens: int, req_id: str, needs_every_position: bool) -> Request:
    return Request(req_id=req_id, prompt_token_ids=[100 + i for i in range(num_prompt_tokens)],
                   sampling_params=SamplingParams(max_tokens=1), eos_token_ids=frozenset(), max_tokens=0,
                   pooling_params=PoolingParams(needs_every_position=needs_every_position))


def pool_step(sched):
    """One step whose runner pools each request it completes (vector [num_tokens]) and samples for the rest."""
    out = sched.schedule()
    pooled, sampled = {}, {}
    for req_id in out.num_scheduled_tokens:
        request = sched.requests[req_id]
        if request.num_computed_tokens == request.num_tokens:
            if request.pooling_params is not None:
                pooled[req_id] = [float(request.num_tokens)]
            else:
                sampled[req_id] = [7]
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled, pooled=pooled))


def test_chunked_pooling_request_finishes_with_its_last_chunk_and_frees_its_blocks():
    sched = make_scheduler(max_num_batched_tokens=5, block_size=4, enable_caching=True)
    req = make_pooling_request(12, "p", needs_every_position=True)
    sched.add_request(req)
    chunks, outputs = [], []
    for _ in range(3):
        out, step_outputs = pool_step(sched)
        chunks.append(out.num_scheduled_tokens["p"])
        outputs.append(step_outputs)
    assert chunks == [5, 5, 2]
    assert outputs[:2] == [[], []]
    [final] = outputs[2]
    assert (final.req_id, final.new_token_ids, final.finish_reason, final.pooled) == ("p", [], "stop", [12.0])
    assert req.status == RequestStatus.FINISHED_STOPPED and not sched.has_unfinished_requests()
    assert sched.kv.check_no_leaks() == [] and sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule().finished_req_ids == {"p"}  # the runner drops its kept rows


def test_prefix_hits_only_for_last_token_pooling():
    sched = make_scheduler(max_num_batched_tokens=64, block_size=4, enable_caching=True)
    sched.add_request(make_pooling_request(12, "first", needs_every_position=False))
    pool_step(sched)
    mean = make_pooling_request(12, "mean", needs_every_position=True)
    last = make_pooling_request(12, "last", needs_every_position=False)
    sched.add_request(mean)
    sched.add_request(last)
    out, outputs = pool_step(sched)
    # 12 tokens = 3 full blocks; the last token is never served from the cache, so 2 blocks (8 tokens) hit
    assert out.num_scheduled_tokens == {"mean": 12, "last": 4}
    assert {o.req_id: o.num_cached_tokens for o in outputs} == {"mean": 0, "last": 8}


def test_pooling_and_generation_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=64)
    gen = make_request(5)
    sched.add_request(gen)
    sched.add_request(make_pooling_request(6, "p", needs_every_position=True))
    out, outputs = pool_step(sched)
    assert out.num_scheduled_tokens == {gen.req_id: 5, "p": 6}
    assert {o.req_id: (o.new_token_ids, o.finish_reason) for o in outputs} == {gen.req_id: ([7], None),
                                                                                "p": ([], "stop")}


def test_a_complete_prompt_without_a_vector_fails_alone():
    sched = make_scheduler()
    sched.add_request(make_pooling_request(6, "p", needs_every_position=True))
    _, outputs = step(sched)  # a runner that samples and never pools
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("p", "abort")] and "no pooled vector" in outputs[0].error
    assert not sched.has_unfinished_requests() and sched.kv.check_no_leaks() == []
