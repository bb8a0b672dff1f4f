"""Builders for core tests: requests and a stand-in for the model's sampled tokens."""

from __future__ import annotations

import itertools

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

EOS = 2
_ids = itertools.count()


def make_request(num_prompt_tokens: int, max_tokens: int = 8, req_id: str | None = None,
                 first_token: int = 100, **params) -> Request:
    prompt = [first_token + i for i in range(num_prompt_tokens)]
    return Request(
        req_id=req_id if req_id is not None else f"r{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}),
        max_tokens=max_tokens,
    )


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256,
                   enable_caching: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching))


def sample_for(sched: Scheduler, out: SchedulerOutput, token_id: int = 7) -> ModelRunnerOutput:
    """What a runner returns: one token for every request whose known tokens are all computed."""
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        request = sched.requests.get(req_id)
        if request is not None and request.num_computed_tokens == request.num_tokens:
            sampled[req_id] = [token_id]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def step(sched: Scheduler, token_id: int = 7):
    out = sched.schedule()
    return out, sched.update_from_output(out, sample_for(sched, out, token_id))
