"""A tiny Qwen3 written as llama.cpp writes the ``qwen3`` GGUF architecture (Llama tensor names
plus ``attn_q_norm`` / ``attn_k_norm``; Q/K rows not permuted, its rope being rotate-half) loads
and matches its Hugging Face twin, through the engine."""

import pytest

from pagedllm import LLM
from pagedllm.model import load_model
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.gguf_writer_helpers import write_converted_gguf
from tests.model.tiny_models import make_hf_model


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def test_qwen3_gguf_matches_hf(tmp_path):
    hf_model = make_hf_model("qwen3", seed=2, max_position_embeddings=1024)
    hf_model.generation_config.eos_token_id = None
    path = tmp_path / "tiny-qwen3-f32.gguf"
    write_converted_gguf(hf_model, path)  # F32
    loaded = load_model(str(path))
    assert type(loaded.model).__name__ == "Qwen3ForCausalLM"
    assert loaded.hf_config.head_dim == hf_model.config.head_dim == 32  # != hidden / heads (16)

    llm = LLM(model=str(path), max_num_batched_tokens=37)
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40, 77)]
    for prompt, (ids, logprobs) in zip(prompts, engine_greedy(llm, prompts, 10)):
        assert assert_matches_reference(ids, logprobs, hf_greedy(hf_model, prompt, 10), "qwen3 gguf") == "exact"
