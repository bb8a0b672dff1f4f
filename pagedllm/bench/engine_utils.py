"""Building engines for benchmarks: the allocation policy, and running a trace through them."""

from __future__ import annotations

from pagedllm.bench.workloads import BenchRequest
from pagedllm.core.contiguous_allocator import ContiguousKVCacheManager
from pagedllm.sampling_params import SamplingParams


def install_kv_policy(core, policy: str, allocator: str = "first_fit") -> None:
    """Replace an idle EngineCore's paged KV manager by a contiguous-reservation one (same KV tensors).

    'paged' leaves the core as it is. The scheduler is rebuilt around the new manager; the model
    runner is untouched, since contiguous regions are handed out as ordinary block tables.
    """
    assert not core.scheduler.has_unfinished_requests(), "change the policy of an idle engine only"
    if policy == "paged":
        if not isinstance(core.scheduler.kv, ContiguousKVCacheManager):
            return
        from pagedllm.core.kv_cache_manager import KVCacheManager

        manager = KVCacheManager(core.num_blocks, core.cache_config.block_size, core.cache_config.enable_prefix_caching)
    else:
        manager = ContiguousKVCacheManager(
            core.num_blocks, core.cache_config.block_size, policy, core.scheduler_config.max_model_len, allocator
        )
    core.kv_cache_manager = manager
    core.scheduler = type(core.scheduler)(core.scheduler_config, manager)


def build_llm(policy: str = "paged", allocator: str = "first_fit", **engine_args):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**engine_args)
    install_kv_policy(llm.engine.core, policy, allocator)
    return llm


def request_params(request: BenchRequest, temperature: float = 0.0) -> SamplingParams:
    """Exactly `output_len` tokens: ignore_eos, so the final length is known in advance."""
    return SamplingParams(n=request.n, max_tokens=request.output_len, ignore_eos=True, temperature=temperature,
                          seed=0 if temperature > 0 else None)


def engine_prompts(requests: list[BenchRequest]) -> list[dict]:
    return [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
