"""Greedy outputs token-for-token identical to Hugging Face transformers, batched together,
also under forced chunked prefill and forced preemption."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.model.loader import resolve_hf_dir
from pagedllm import LLM
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.tiny_models import make_hf_model, save_hf_model

MAX_NEW_TOKENS = 16
# A step budget that is small and odd forces every long prompt through chunked prefill.
CHUNKED = dict(max_num_batched_tokens=37)


def _prompt_lengths() -> list[int]:
    # 1 token to over 300; several around block boundaries (16, 32, ...)
    return [1, 2, 5, 15, 16, 17, 31, 33, 47, 64, 100, 128, 129, 200, 257, 321]


def _random_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in _prompt_lengths()]


def _check_all(llm, prompts, references, label, ignore_eos=False, with_logprobs=True):
    results = engine_greedy(llm, prompts, MAX_NEW_TOKENS, ignore_eos, with_logprobs)
    verdicts = []
    for prompt, ref, (ids, logprobs) in zip(prompts, references, results):
        verdicts.append(assert_matches_reference(ids, logprobs, ref, f"{label}, prompt of {len(prompt)} tokens"))
    # Near-ties are tolerated, not expected: most prompts must match exactly.
    assert verdicts.count("exact") >= len(verdicts) - 2, verdicts
    assert llm.engine.core.check_kv_leaks() == []
    return verdicts


# --- tiny random models: Llama with GQA, Qwen2 with q/k/v bias ----------------------------

@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_setup(request, tmp_path_factory):
    hf_model = make_hf_model(request.param, seed=1, max_position_embeddings=1024)
    hf_model.generation_config.eos_token_id = None
    path = save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))
    prompts = _random_prompts(hf_model.config.vocab_size, seed=7)
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    return request.param, path, prompts, references


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="one-batch"),
        pytest.param(CHUNKED, id="chunked-prefill"),
        # 24 blocks of 4 tokens: the 321-token prompt alone needs 85 -> use block_size 16:
        pytest.param(dict(block_size=16, num_kv_blocks=26, max_num_batched_tokens=64), id="preemption"),
    ],
)
def test_tiny_models_match_hf(tiny_setup, engine_kwargs):
    kind, path, prompts, references = tiny_setup
    llm = LLM(model=path, **engine_kwargs)
    _check_all(llm, prompts, references, f"{kind} {engine_kwargs}", ignore_eos=True)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.core.scheduler.num_preemptions > 0, "the run was meant to preempt"


# --- the embedded default model -------------------------------------------------------------

DEFAULT_PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Translate to French: The cat sits on the mat.",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Explain why the sky is blue in one sentence.",
    "Water boils at",
    "A haiku about memory pages:",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Q: What is the largest planet in our solar system?\nA:",
    "Paged memory lets an operating system " * 8,
    "In 1969, the first humans walked on the Moon. " * 20,
]


# The default model is the slow tier's: loading it and running HF beside it takes most of a minute.
@pytest.fixture(scope="module")
def default_setup():
    llm = LLM(quant_activations="none")  # the embedded default model (exact mode), converted once into the cache
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in DEFAULT_PROMPTS]
    prompts.insert(0, [tokenizer.encode("Hello")[0]])  # a one-token prompt
    assert len(prompts) >= 16 and len(prompts[0]) == 1 and max(map(len, prompts)) > 300
    hf_model = AutoModelForCausalLM.from_pretrained(resolve_hf_dir(None), dtype=torch.float32).eval()
    eos = llm.engine.input_processor.eos_token_ids
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS, eos_token_id=eos) for p in prompts]
    del hf_model
    return llm, prompts, references


@pytest.mark.slow
def test_default_model_matches_hf_in_one_batch(default_setup):
    llm, prompts, references = default_setup
    _check_all(llm, prompts, references, "default model")


@pytest.mark.slow
def test_default_model_matches_hf_through_the_greedy_head(default_setup, monkeypatch):
    """No logprobs asked: steps of 4+ rows take the exact bfloat16-candidates LM head
    (model/layers/greedy_head.py) where the CPU has AMX-BF16, and must still match HF."""
    from pagedllm.model.layers.greedy_head import GreedyFallback, cpu_has_fast_bf16

    llm, prompts, references = default_setup
    model = llm.engine.core.executor.runner.model
    used = []
    greedy_token_ids = model.greedy_token_ids
    monkeypatch.setattr(model, "greedy_token_ids", lambda h: used.append(greedy_token_ids(h)) or used[-1])
    _check_all(llm, prompts, references, "default model, greedy head", with_logprobs=False)
    if cpu_has_fast_bf16() and model.lm_head.quant_weight is None:  # a quantized head keeps no bfloat16 copy
        assert any(not isinstance(ids, GreedyFallback) for ids in used), "no step took the greedy head"


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param(CHUNKED, id="chunked-prefill"),
        pytest.param(dict(num_kv_blocks=30, max_num_batched_tokens=128), id="preemption"),
    ],
)
@pytest.mark.slow
def test_default_model_matches_hf_under_pressure(default_setup, engine_kwargs):
    _, prompts, references = default_setup
    llm = LLM(quant_activations="none", **engine_kwargs)
    _check_all(llm, prompts, references, f"default model {engine_kwargs}")
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
