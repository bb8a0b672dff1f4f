"""Llama 3.1+ GGUF files carry their "llama3" rope scaling as ``rope_freqs.weight`` (a divisor per rotary
frequency, computed by llama.cpp's converter): such a file loads, and generates greedily as transformers does
with the checkpoint's own rope parameters."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from pagedllm import LLM
from pagedllm.model import load_model
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.gguf_writer_helpers import llama3_rope_freqs, write_llama_gguf
from tests.model.tiny_models import make_hf_model


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("qtype", ["Q8_0"])  # the rope is the same whatever the weights' type
def test_rope_freqs_file_matches_hf_llama3_rope(qtype, tmp_path):
    hf_model = make_hf_model("llama_tied_scaled", seed=5)  # rope_type llama3, factor 8, original context 64
    hf_model.generation_config.eos_token_id = None
    factors = llama3_rope_freqs(hf_model.config)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).sum() >= 2  # all 3 parts
    path = tmp_path / f"llama3-rope-{qtype}.gguf"
    hf_model.load_state_dict(write_llama_gguf(hf_model, path, GGMLQuantizationType[qtype],
                                              extra={"rope_freqs.weight": factors}))

    config = load_model(str(path)).hf_config
    assert np.array_equal(np.array(config.rope_freq_factors, dtype=np.float32), factors)
    llm = LLM(model=str(path), max_num_batched_tokens=37, quant_activations="none")
    prompts = [list(range(3, 3 + n)) for n in (1, 20, 90)]  # 90 + 12 positions: past the original 64
    for prompt, (ids, logprobs) in zip(prompts, engine_greedy(llm, prompts, 12)):
        ref = hf_greedy(hf_model, prompt, 12)
        assert assert_matches_reference(ids, logprobs, ref, f"llama3 rope {qtype} gguf") == "exact"


def test_without_its_factors_the_file_would_not_match(tmp_path):
    """The check above can fail: the same file without rope_freqs (plain RoPE) generates differently."""
    hf_model = make_hf_model("llama_tied_scaled", seed=5)
    hf_model.generation_config.eos_token_id = None
    path = tmp_path / "plain.gguf"
    hf_model.load_state_dict(write_llama_gguf(hf_model, path, GGMLQuantizationType.F32))
    llm = LLM(model=str(path), max_num_batched_tokens=37, quant_activations="none")
    prompt = list(range(3, 93))
    (ids, _), = engine_greedy(llm, [prompt], 12)
    ref = hf_greedy(hf_model, prompt, 12)
    with pytest.raises(AssertionError):
        assert_matches_reference(ids, None, ref, "plain rope")
