"""Building engines for benchmarks: the allocation policy, and running a trace through them."""

from __future__ import annotations

from pagedllm.bench.contiguous_allocator import kv_cache_manager_factory
from pagedllm.bench.workloads import BenchRequest
from pagedllm.core.kv_cache_interface import plugged_kv_cache_manager
from pagedllm.sampling_params import SamplingParams


def build_llm(policy: str = "paged", allocator: str = "first_fit", **engine_args):
    """An offline LLM whose KV cache manager follows `policy` ('paged', 'max', 'pow2' or 'oracle').

    The policy goes in through the KV cache interface's one injection point (plugged while the engine core is
    made), so every other engine argument (preemption_mode included) holds as given.
    """
    from pagedllm.entrypoints.llm import LLM

    with plugged_kv_cache_manager(kv_cache_manager_factory(policy, allocator)):
        return LLM(**engine_args)


def request_params(request: BenchRequest, temperature: float = 0.0) -> SamplingParams:
    """Exactly `output_len` tokens: ignore_eos, so the final length is known in advance."""
    return SamplingParams(n=request.n, max_tokens=request.output_len, ignore_eos=True, temperature=temperature,
                          seed=0 if temperature > 0 else None)


def engine_prompts(requests: list[BenchRequest]) -> list[dict]:
    return [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
