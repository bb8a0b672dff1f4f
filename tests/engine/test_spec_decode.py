"""Speculative decoding (n-gram) never changes greedy outputs: the same engine with and without it,
token for token, batched, chunked, preempted (recompute and swap), with prefix caching and n > 1.

A random tiny model never repeats itself, so proposals would all be rejected; `copy_model` bends one
so that its output mostly follows a fixed token -> next-token map of 7-cycles (the embedding dominates
the residual stream and the LM head maps it to its successor), while the layers still perturb it:
proposals are then often accepted and often rejected, and both paths run."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.model.tiny_models import make_hf_model, save_hf_model


def copy_model(seed: int = 3, cycle: int = 7, **config_overrides):
    model = make_hf_model("llama", seed=seed, max_position_embeddings=1024, **config_overrides)
    vocab = model.config.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    successor = torch.empty(vocab, dtype=torch.long)
    for start in range(0, vocab, cycle):
        members = perm[start:start + cycle]
        successor[members] = torch.roll(members, -1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5)
            layer.mlp.down_proj.weight.mul_(0.5)
        embed = model.model.embed_tokens.weight
        embed.mul_(10.0)
        head = torch.zeros_like(model.lm_head.weight)
        head[successor] = embed.clone()  # the logit of successor[x] is large when the residual is ~ embed[x]
        model.lm_head.weight.add_(head)
    return model


@pytest.fixture(scope="module")
def copy_model_dir(tmp_path_factory):
    return save_hf_model(copy_model(), tmp_path_factory.mktemp("tiny-copy"))


def _prompts(num: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = []
    for i in range(num):
        body = [rng.randrange(3, 500) for _ in range(5 + 3 * i)]
        prompts.append((shared if i % 2 else []) + body + body[:4])
    return prompts


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _run(llm: LLM, params, prompts=None) -> list[list[list[int]]]:
    prompts = prompts or _prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.core.check_kv_leaks() == []
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _spec(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **extra}


def _stats(llm: LLM):
    return llm.engine.core.stats()


@pytest.fixture(scope="module")
def baseline(copy_model_dir):
    return _run(LLM(model=copy_model_dir), GREEDY)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_identical_for_each_k(copy_model_dir, baseline, k):
    llm = LLM(model=copy_model_dir, speculative_config=_spec(k))
    assert _run(llm, GREEDY) == baseline
    stats = _stats(llm)
    assert stats.spec_num_accepted_tokens > 0, "no proposal was ever accepted: the test exercises nothing"
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, "no proposal was ever rejected"
    assert len(stats.spec_accepted_per_position) == k
    assert stats.spec_proposed_per_position[0] >= stats.spec_proposed_per_position[-1]


CONFIGS = {
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "recompute-preemption": dict(num_kv_blocks=20, preemption_mode="recompute", block_size=8),
    "swap-preemption": dict(num_kv_blocks=20, preemption_mode="swap", block_size=8, swap_space="4MiB"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_under_memory_and_budget_pressure(copy_model_dir, name):
    config = CONFIGS[name]
    reference = _run(LLM(model=copy_model_dir, **config), GREEDY)
    llm = LLM(model=copy_model_dir, speculative_config=_spec(4), **config)
    assert _run(llm, GREEDY) == reference
    stats = _stats(llm)
    assert stats.spec_num_accepted_tokens > 0
    if "preemption" in name:
        assert stats.num_preemptions > 0, "the configuration was meant to preempt"
    if name == "swap-preemption":
        assert stats.num_swap_outs > 0


def test_the_runner_takes_tables_and_computed_counts_from_the_scheduler_through_rollbacks(copy_model_dir):
    """The rollback is computed once, by the scheduler: after each step's diffs the runner's block tables
    and computed counts are the scheduler's, and rollbacks that freed blocks reach it as num_kept_block_ids."""
    reference = _run(LLM(model=copy_model_dir, block_size=4), GREEDY)
    llm = LLM(model=copy_model_dir, speculative_config=_spec(4), block_size=4)
    core = llm.engine.core
    runner = core.executor.runner
    real_update_states = runner._update_states
    seen = {"checked": 0, "cut": 0}

    def update_states(sched):
        before = {c.req_id: len(runner.requests[c.req_id].block_ids) for c in sched.scheduled_cached_reqs}
        real_update_states(sched)
        seen["cut"] += sum(c.num_kept_block_ids is not None and c.num_kept_block_ids < before[c.req_id]
                           for c in sched.scheduled_cached_reqs)
        for req_id, n in sched.num_scheduled_tokens.items():
            state, request = runner.requests[req_id], core.scheduler.requests[req_id]
            assert state.block_ids == core.kv_cache_manager.get_block_ids(req_id), req_id
            assert state.num_computed_tokens + n == request.num_computed_tokens, req_id  # the scheduler counts ahead
            seen["checked"] += 1

    runner._update_states = update_states
    assert _run(llm, GREEDY) == reference
    assert seen["checked"] > 0 and seen["cut"] > 0, seen


def test_greedy_identical_with_parallel_samples(copy_model_dir):
    params = SamplingParams(n=3, temperature=0, max_tokens=40, ignore_eos=True)
    reference = _run(LLM(model=copy_model_dir), params)
    llm = LLM(model=copy_model_dir, speculative_config=_spec(3))
    assert _run(llm, params) == reference
    assert _stats(llm).spec_num_accepted_tokens > 0


def test_stop_tokens_min_tokens_max_tokens_and_logprobs_as_without(copy_model_dir, baseline):
    # Stop on tokens the outputs produce mid-speculation; min_tokens holds them off for a while.
    stops = sorted({seq[0][10] for seq in baseline[:4]} | {seq[0][20] for seq in baseline[4:]})
    params = [SamplingParams(temperature=0, max_tokens=5 + 7 * i, stop_token_ids=stops, min_tokens=3 * (i % 3),
                             logprobs=2) for i in range(len(_prompts()))]
    plain = LLM(model=copy_model_dir).generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    llm = LLM(model=copy_model_dir, speculative_config=_spec(5))
    spec = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    assert llm.engine.core.check_kv_leaks() == []
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for token in la:
                assert abs(la[token].logprob - lb[token].logprob) < 1e-3
    assert {o.outputs[0].finish_reason for o in spec} == {"stop", "length"}
    assert _stats(llm).spec_num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_with_speculation(copy_model_dir):
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=32, seed=i, ignore_eos=True) for i in range(6)]
    runs = []
    for _ in range(2):
        llm = LLM(model=copy_model_dir, speculative_config=_spec(3))
        runs.append(_run(llm, params, _prompts(6)))
        assert _stats(llm).spec_num_draft_tokens > 0
    assert runs[0] == runs[1]


def test_off_by_default_and_bad_configs_refused(copy_model_dir):
    from pagedllm.config import EngineArgs

    assert EngineArgs().speculative() is None
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 0}, {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
                {"num_tokens": 3}):
        with pytest.raises(ValueError):
            EngineArgs(speculative_config=bad)
