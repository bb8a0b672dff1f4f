"""N-gram speculation on the default model (SmolLM2-135M-Instruct): greedy outputs unchanged, token for
token, on copy-heavy chat prompts (where proposals are accepted) batched with ordinary ones, with
chunked prefill, recompute preemption, prefix caching and n > 1."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # HF equivalence on the default model

PASSAGE = ("The quick brown fox jumps over the lazy dog. Paged attention stores the key-value cache in "
           "fixed-size blocks, so memory is allocated on demand and shared between sequences.")
PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Fix the spelling in this sentence and repeat it: Teh quick brwon fox jumps over the lazy dog.",
    "What is the capital of France?",
    f"Quote the second sentence of this text:\n\n{PASSAGE}",
]


def _chat(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _run(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    prompts = [{"prompt_token_ids": _chat(llm, p)} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.check_kv_leaks() == []
    return [[c.token_ids for c in o.outputs] for o in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=40)
NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4}


# Engines shared by the module (a default-model engine costs seconds to build). Their prefix caches are
# warm after the first test: these tests compare greedy tokens (and stop points), which a prefix hit leaves
# unchanged, and speculation acts in the decode steps, which run whatever the prefill found cached.
@pytest.fixture(scope="module")
def plain_llm():
    return LLM(max_model_len=512, quant_activations="none")


@pytest.fixture(scope="module")
def ngram4_llm():
    return LLM(max_model_len=512, speculative_config=NGRAM4, quant_activations="none")


@pytest.fixture(scope="module")
def reference(plain_llm):
    return _run(plain_llm, GREEDY)


@pytest.mark.parametrize("k,config", [
    (1, {}),
    (3, dict(max_num_batched_tokens=32)),
    (5, dict(num_kv_blocks=20, block_size=8, preemption_mode="recompute", enable_prefix_caching=False)),
])
def test_default_model_greedy_identical(reference, k, config):
    llm = LLM(max_model_len=512, speculative_config={"method": "ngram", "num_speculative_tokens": k},
              quant_activations="none", **config)
    assert _run(llm, GREEDY) == reference
    stats = llm.engine.core.stats()
    assert stats.spec_num_accepted_tokens > 0
    if "num_kv_blocks" in config:
        assert stats.num_preemptions > 0


def test_default_model_parallel_samples(reference, ngram4_llm):
    params = SamplingParams(n=2, temperature=0, max_tokens=40)
    assert _run(ngram4_llm, params) == [seqs * 2 for seqs in reference]


def test_default_model_stop_strings_end_where_they_would_without(plain_llm, ngram4_llm):
    """Several tokens arrive per step with speculation; a stop string still ends text and token ids at
    the token that completes it."""
    params = SamplingParams(temperature=0, max_tokens=40, stop=[" lazy", " blocks", "Paris"])
    results = []
    for llm in (plain_llm, ngram4_llm):
        outputs = llm.generate([{"prompt_token_ids": _chat(llm, p)} for p in PROMPTS], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                        for o in outputs])
        assert llm.engine.core.check_kv_leaks() == []
    assert results[0] == results[1]
    assert sum(r[3] is not None for r in results[0]) >= 2  # the stop strings did stop something


@pytest.fixture(scope="module")
def default_drafts(tmp_path_factory):
    """Drafts cut from the default model: its first 4 layers (final norm and tied head kept), and all 30
    (the target itself, through the draft path: its proposals must nearly all be kept)."""
    from pagedllm.model.truncate import write_truncated_model
    from tests.engine.tiny_llama_dir import default_model_dir

    root = tmp_path_factory.mktemp("default-drafts")
    return {layers: str(write_truncated_model(default_model_dir(), root / f"l{layers}", layers)) for layers in (4, 30)}


@pytest.mark.parametrize("k,layers,config", [
    (2, 4, dict(max_num_batched_tokens=32)),
    (4, 30, dict(num_kv_blocks=36, block_size=4, preemption_mode="recompute", enable_prefix_caching=False)),
])
def test_default_model_with_a_draft_model_greedy_identical(reference, default_drafts, k, layers, config):
    llm = LLM(max_model_len=512, speculative_config={"method": "draft_model", "model": default_drafts[layers],
                                                     "num_speculative_tokens": k}, quant_activations="none", **config)
    assert _run(llm, GREEDY) == reference
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0
    if layers == 30:
        assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens
    if "num_kv_blocks" in config:
        assert stats.num_preemptions > 0


def test_default_model_with_a_draft_model_parallel_samples(reference, default_drafts):
    params = SamplingParams(n=2, temperature=0, max_tokens=40)
    llm = LLM(max_model_len=512, enable_prefix_caching=True, quant_activations="none",
              speculative_config={"method": "draft_model", "model": default_drafts[4], "num_speculative_tokens": 3})
    assert _run(llm, params) == [seqs * 2 for seqs in reference]
