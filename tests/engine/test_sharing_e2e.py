"""Memory sharing must never change outputs: prefix caching on/off, under eviction pressure,
swap vs recompute preemption, and parallel samples forked from one prompt."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from tests.model.tiny_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    model = make_hf_model("llama", seed=3, max_position_embeddings=1024)
    return save_hf_model(model, tmp_path_factory.mktemp("tiny-sharing"))


def _prompts() -> list[list[int]]:
    """Requests with common few-shot prefixes (cache hits) and unique ones (misses)."""
    rng = random.Random(11)
    shared_a = [rng.randrange(3, 512) for _ in range(70)]
    shared_b = [rng.randrange(3, 512) for _ in range(37)]
    prompts = []
    for i in range(12):
        prefix = shared_a if i % 3 == 0 else shared_b if i % 3 == 1 else []
        prompts.append(prefix + [rng.randrange(3, 512) for _ in range(5 + 7 * i)])
    return prompts


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1, ignore_eos=True),
]


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    prompts = _prompts()
    seeded = [params if params.seed is None else SamplingParams(
        temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
        seed=params.seed + i, ignore_eos=True) for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
    assert llm.engine.core.check_kv_leaks() == []
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, enable_prefix_caching=False)
    return {i: _generate(llm, p) for i, p in enumerate(PARAMS)}


CONFIGS = {
    "caching-on": dict(enable_prefix_caching=True),
    # 40 blocks of 16: far less than the batch needs, so cached blocks are evicted and requests preempted
    "eviction-pressure": dict(enable_prefix_caching=True, num_kv_blocks=40, max_num_batched_tokens=96),
    "recompute-preemption": dict(enable_prefix_caching=False, num_kv_blocks=24, preemption_mode="recompute"),
    "swap-preemption": dict(enable_prefix_caching=False, num_kv_blocks=24, preemption_mode="swap",
                            swap_space="4MiB"),
    "swap-with-caching": dict(enable_prefix_caching=True, num_kv_blocks=24, preemption_mode="swap",
                              swap_space="4MiB"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("params_index", [0, 1], ids=["greedy", "seeded"])
def test_outputs_identical_under_every_sharing_configuration(tiny_model_dir, baseline, config, params_index):
    llm = LLM(model=tiny_model_dir, **CONFIGS[config])
    assert _generate(llm, PARAMS[params_index]) == baseline[params_index]
    core = llm.engine.core
    stats = core.stats()
    if CONFIGS[config]["enable_prefix_caching"]:
        assert stats.prefix_cache_hits > 0
    if config == "eviction-pressure":
        assert stats.num_evictions > 0 and stats.num_preemptions > 0
    if "preemption" in config or "swap" in config:
        assert stats.num_preemptions > 0
    if "swap" in config:
        assert core.scheduler.num_swap_outs > 0


def test_a_full_host_pool_falls_back_to_recompute(tiny_model_dir, baseline):
    # Host space for one block only: most preemptions cannot swap and must recompute.
    llm = LLM(model=tiny_model_dir, enable_prefix_caching=False, num_kv_blocks=24,
              preemption_mode="swap", swap_space="1KiB", block_size=16)
    assert llm.engine.core.kv_cache_manager.num_host_blocks == 0
    assert _generate(llm, PARAMS[0]) == baseline[0]
    assert llm.engine.core.scheduler.num_swap_outs == 0 and llm.engine.core.stats().num_preemptions > 0


def test_parallel_samples_share_the_prompt_and_match_separate_requests(tiny_model_dir):
    llm = LLM(model=tiny_model_dir)
    prompt = {"prompt_token_ids": _prompts()[5]}  # 42 tokens: 2 full blocks + a partial one
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=100, ignore_eos=True)
    together = llm.generate(prompt, params, use_tqdm=False)[0]
    kv = llm.engine.core.kv_cache_manager
    assert kv.num_cow_copies == 3  # three of the four writers copy the shared partial block
    separate = [
        llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=100 + i, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
        for i in range(4)
    ]
    assert [c.token_ids for c in together.outputs] == separate
    assert llm.engine.core.check_kv_leaks() == []


def test_parallel_samples_survive_preemption(tiny_model_dir):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=7, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:6]]
    roomy = LLM(model=tiny_model_dir).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(model=tiny_model_dir, num_kv_blocks=20)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.engine.core.stats().num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in tight] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert tight_llm.engine.core.check_kv_leaks() == []
