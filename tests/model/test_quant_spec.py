"""Quantized GGUF weights with speculative decoding: the target (and a GGUF draft model, which
loads quantized too) run through the quantized kernel at the several rows a verification step
scores, and greedy outputs equal plain decoding of the same quantized model."""

import pytest
from gguf import GGMLQuantizationType

from pagedllm import LLM
from pagedllm.model.layers import quantized
from tests.hf_reference import engine_greedy
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.tiny_models import make_hf_model

pytestmark = pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@pytest.mark.usefixtures("int8_kernels_only")
def test_speculative_decoding_on_quantized_weights(tmp_path):
    """The int8 kernels at every row count: on a CPU with AMX a step of 96+ rows takes the bf16 prefill path, whose
    rounding differs, and speculation changes how prompts share steps (tests/model/test_bf16_prefill.py)."""
    target, draft = tmp_path / "target-Q4_1.gguf", tmp_path / "draft-Q8_0.gguf"
    write_llama_gguf(make_hf_model("llama", seed=8), target, GGMLQuantizationType.Q4_1)
    write_llama_gguf(make_hf_model("llama", seed=9, num_hidden_layers=1), draft, GGMLQuantizationType.Q8_0)
    plain = LLM(model=str(target), num_kv_blocks=64)
    assert plain.engine.core.executor.runner.model.lm_head.quant_weight is not None
    # Each prompt, its own continuation, the prompt again: n-gram lookups find guesses.
    seeds = [[5, 6, 7, 8] * 3, list(range(3, 20)), [9, 10, 11] * 4]
    prompts = [p + ids + p for p, (ids, _) in zip(seeds, engine_greedy(plain, seeds, 12))]
    expected = [ids for ids, _ in engine_greedy(plain, prompts, 12)]
    del plain
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
                 {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}):
        llm = LLM(model=str(target), num_kv_blocks=64, speculative_config=spec)
        if spec["method"] == "draft_model":
            draft_model = llm.engine.core.executor.draft_loaded.model
            assert draft_model.model.layers[0].mlp.down_proj.quant_weight is not None
        assert [ids for ids, _ in engine_greedy(llm, prompts, 12)] == expected, spec["method"]
        # Guesses were made, so verification steps scored several rows a sequence (a random tiny
        # model rarely repeats itself: whether they were accepted is not what this tests).
        assert llm.engine.core.stats().spec_num_draft_tokens > 0, spec["method"]
        del llm
