"""The batch-invariant mode (issue 29): one request's per-token logprobs are bitwise equal (``==``)
alone and in batches of 2-64 random neighbours, with its prompt chunked at several
max_num_batched_tokens, after a prefix-cache hit, after preemption by recompute and by swap, at 1
and 2 threads, and for a seeded sampled request; on a tiny random Llama (float32, compiled GEMM)
and on the default model (Q4_1 kernels). Speculative decoding and random schedules:
test_batch_invariance_schedules.py; the kernels alone: test_batch_invariant_kernels.py.

Without the mode the same comparisons differ in the low bits (the GEMMs' accumulator sets change
with the row count, attention switches paths and splits with the batch): see
``test_default_mode_is_not_invariant``, which keeps the tests honest (they can fail).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.attention import cpu_op
from tests.engine.tiny_llama_dir import build_tiny_llama_dir

pytestmark = pytest.mark.skipif(not cpu_op.load(), reason="the mode needs the compiled CPU ops")

NUM_TOKENS = 10
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 4000) for _ in range(length)]


TARGET = _prompt(random.Random(29), 70)  # 70 tokens: several blocks, several chunks below


def _neighbours(seed: int, count: int, most_tokens: int = 16) -> tuple[list[dict], list[SamplingParams]]:
    """Random prompts (5-120 tokens) and lengths (1-``most_tokens`` tokens): the batch changes every
    few steps."""
    rng = random.Random(seed)
    inputs = [{"prompt_token_ids": _prompt(rng, rng.randrange(5, 120))} for _ in range(count)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, most_tokens + 1), ignore_eos=True)
              for _ in range(count)]
    return inputs, params


def _logprobs(llm: LLM, neighbours: int = 0, seed: int = 0, most_tokens: int = 16,
              target: SamplingParams = PARAMS) -> list[list[tuple[int, float]]]:
    """The target's per-token top logprobs (the sampled token's first), run with ``neighbours``
    random requests around it."""
    inputs, params = _neighbours(seed, neighbours, most_tokens)
    at = random.Random(seed).randrange(neighbours + 1)
    inputs.insert(at, {"prompt_token_ids": TARGET})
    params.insert(at, target)
    out = llm.generate(inputs, params, use_tqdm=False)[at].outputs[0]
    assert len(out.token_ids) == NUM_TOKENS
    return [[(token, step[token].logprob)] + sorted((t, lp.logprob) for t, lp in step.items())
            for token, step in zip(out.token_ids, out.logprobs)]


def _llm(model: str, **kwargs) -> LLM:
    return LLM(model=model, batch_invariant=True, **{"block_size": 16, **kwargs})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama with head_dim 32 (the compiled attention op's smallest; the shared tiny
    directory's 16 goes to the torch reference, which the mode refuses)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny_bi"), initializer_range=0.2)
    config = LlamaConfig.from_pretrained(path)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 32
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_refuses_kernels_without_an_invariant_call(tmp_path):
    path = build_tiny_llama_dir(tmp_path)  # head_dim 16: attention would fall back to SDPA
    with pytest.raises(ValueError, match="head_dim 16"):
        LLM(model=str(path), batch_invariant=True)


@pytest.fixture(scope="module", params=["tiny", pytest.param("default", marks=pytest.mark.slow)])
def setup(request, tiny_dir):
    """(model, the target's logprobs alone at 1 thread with the whole prompt in one step)."""
    model = tiny_dir if request.param == "tiny" else None
    threads = torch.get_num_threads()
    try:
        reference = _logprobs(_llm(model, num_threads=1, enable_prefix_caching=False))
        yield model, reference
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_batches_of_random_neighbours(setup, threads):
    model, reference = setup
    llm = _llm(model, num_threads=threads, enable_prefix_caching=False)
    assert _logprobs(llm) == reference
    for size in (2, 4, 9, 16):
        assert _logprobs(llm, neighbours=size - 1, seed=size) == reference, f"batch of {size}, {threads} threads"


@pytest.mark.parametrize("budget", [5, 16, 37, 64])  # 5: chunks short enough for the per-key path by default
def test_chunked_prefill(setup, budget):
    model, reference = setup
    llm = _llm(model, num_threads=2, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert _logprobs(llm, neighbours=5, seed=budget) == reference


def test_after_a_prefix_cache_hit(setup):
    model, reference = setup
    llm = _llm(model, num_threads=2, enable_prefix_caching=True)
    # Another request with the target's first 48 tokens (3 full blocks) leaves them cached.
    llm.generate([{"prompt_token_ids": TARGET[:48] + [7, 8, 9]}], SamplingParams(max_tokens=1), use_tqdm=False)
    hits = llm.engine.core.stats().prefix_cache_hits
    assert _logprobs(llm, neighbours=3, seed=5) == reference
    assert llm.engine.core.stats().prefix_cache_hits > hits, "the target was meant to hit the prefix cache"


def test_after_preemption_by_recompute(setup):
    model, reference = setup
    # 40 blocks of 4 tokens for 8 requests of up to 180 tokens: running requests run out of blocks
    # as they decode, and the newest are preempted and recomputed.
    llm = _llm(model, num_threads=2, block_size=4, num_kv_blocks=40, preemption_mode="recompute",
               enable_prefix_caching=False)
    got = _logprobs(llm, neighbours=7, seed=11, most_tokens=60)
    assert llm.engine.core.stats().num_preemptions > 0, "the cache was meant to be too small"
    assert got == reference


def test_after_preemption_by_swap(setup):
    model, reference = setup
    llm = _llm(model, num_threads=2, block_size=4, num_kv_blocks=40, preemption_mode="swap", swap_space="64MiB",
               enable_prefix_caching=False)
    got = _logprobs(llm, neighbours=7, seed=11, most_tokens=60)
    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0, "the cache was meant to be too small"
    assert got == reference


def test_a_batch_of_64(tiny_dir):
    reference = _logprobs(_llm(tiny_dir, num_threads=1, enable_prefix_caching=False))
    llm = _llm(tiny_dir, num_threads=2, enable_prefix_caching=False, max_num_seqs=64)
    for seed in (64, 65):
        assert _logprobs(llm, neighbours=63, seed=seed) == reference


@pytest.mark.slow
def test_a_batch_of_64_quantized(setup):
    model, reference = setup
    if model is not None:
        pytest.skip("the tiny model's batch of 64 is test_a_batch_of_64")
    llm = _llm(model, num_threads=2, enable_prefix_caching=False, max_num_seqs=64)
    assert _logprobs(llm, neighbours=63, seed=64, most_tokens=8) == reference


def _seeded_sampling_whatever_the_batch(model: str | None) -> None:
    """A seeded request samples the same tokens (and logprobs) alone and beside other sampled requests."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=29, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=3)
    alone = _logprobs(_llm(model, num_threads=1, enable_prefix_caching=False), target=seeded)
    llm = _llm(model, num_threads=2, max_num_batched_tokens=37, enable_prefix_caching=False)
    for size in (4, 16):
        assert _logprobs(llm, neighbours=size - 1, seed=size, target=seeded) == alone, f"batch of {size}"
    # (not the greedy answer: the seed mattered)
    greedy = _logprobs(_llm(model, num_threads=1, enable_prefix_caching=False))
    assert [step[0][0] for step in alone] != [step[0][0] for step in greedy]


def test_seeded_sampling_whatever_the_batch(tiny_dir):
    _seeded_sampling_whatever_the_batch(tiny_dir)


@pytest.mark.slow
def test_seeded_sampling_whatever_the_batch_quantized():
    _seeded_sampling_whatever_the_batch(None)


def test_default_mode_is_not_invariant(tiny_dir):
    """Without the mode, the same comparisons differ: the tests above can fail."""
    llm = LLM(model=tiny_dir, block_size=16, num_threads=1, enable_prefix_caching=False)
    alone = _logprobs(llm)
    assert any(_logprobs(llm, neighbours=size - 1, seed=size) != alone for size in (2, 4, 9, 16))


@pytest.mark.parametrize("planted", [
    ("INVARIANT_KERNELS", False),  # the linears' default kernels: 1-4-row blocks split K over 2-4 sums
    ("ATTENTION_TILE_MIN_ROWS", 0),  # the op's default: chunks of 10+ rows take the tiled path
])
def test_a_planted_reduction_order_change_is_caught(tiny_dir, monkeypatch, planted):
    """One kernel call of the mode put back to a row-count-dependent order: the comparisons above
    (batches, then chunked prefill) see it."""
    from pagedllm.model import batch_invariant

    monkeypatch.setattr(batch_invariant, *planted)
    reference = _logprobs(_llm(tiny_dir, num_threads=1, enable_prefix_caching=False))
    llm = _llm(tiny_dir, num_threads=1, enable_prefix_caching=False)
    chunked = _llm(tiny_dir, num_threads=1, max_num_batched_tokens=5, enable_prefix_caching=False)
    assert (any(_logprobs(llm, neighbours=size - 1, seed=size) != reference for size in (2, 4, 9, 16))
            or _logprobs(chunked, neighbours=5, seed=5) != reference)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3-MoE (8 experts, top 2, head_dim 32): an expert's rows in a step, and the
    router's, change with the batch."""
    from tests.model.tiny_models import make_hf_model, save_hf_model

    return save_hf_model(make_hf_model("qwen3_moe", seed=5, vocab_size=4000, max_position_embeddings=512),
                         tmp_path_factory.mktemp("tiny_moe_bi"))


def _moe_invariant(moe_dir: str) -> bool:
    reference = _logprobs(_llm(moe_dir, num_threads=1, enable_prefix_caching=False))
    llm = _llm(moe_dir, num_threads=2, enable_prefix_caching=False)
    chunked = _llm(moe_dir, num_threads=2, max_num_batched_tokens=16, enable_prefix_caching=False)
    return (all(_logprobs(llm, neighbours=size - 1, seed=size) == reference for size in (2, 4, 9, 16))
            and _logprobs(chunked, neighbours=5, seed=3) == reference)


def test_mixture_of_experts(moe_dir):
    assert _moe_invariant(moe_dir)


def test_mixture_of_experts_without_its_invariant_calls_is_caught(moe_dir, monkeypatch):
    """The experts and router on their default kernels (the dense layers still in the mode): the
    comparisons of test_mixture_of_experts fail."""
    from types import SimpleNamespace

    from pagedllm.model.layers import moe

    monkeypatch.setattr(moe, "batch_invariant", SimpleNamespace(chosen=lambda: False))  # the MoE layers' choice
    assert not _moe_invariant(moe_dir)
