"""The embedded default (SmolLM2-135M-Instruct GGUF): converted once, cached, and equal to transformers."""

import pytest
import torch

from pagedllm.model import gguf_loader, load_model
from pagedllm.model.loader import load_model_info, resolve_hf_dir
from tests.model.paged_kv_helpers import PagedRunner

pytestmark = pytest.mark.slow  # HF equivalence on the default model


@pytest.fixture(scope="module")
def hf_reference(default_model):
    from transformers import AutoModelForCausalLM

    loaded, cache, _ = default_model
    with pytest.MonkeyPatch.context() as mp:  # the float32 weights: written into the directory on request
        mp.setenv("PAGEDLLM_CACHE", str(cache))
        assert str(resolve_hf_dir(None)) == loaded.model_path
    return AutoModelForCausalLM.from_pretrained(loaded.model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    loaded, _, _ = default_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_first_load_converts_into_cache(default_model):
    loaded, cache, num_conversions = default_model
    assert num_conversions == 1
    assert loaded.model_path == str(cache / "smollm2-135m-instruct")
    assert loaded.hf_config.num_hidden_layers == 30 and loaded.hf_config.tie_word_embeddings
    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
    assert loaded.tokenizer.decode(loaded.tokenizer("Hello world")["input_ids"]) == "Hello world"


def test_the_tokenizer_is_read_at_first_use(default_model, monkeypatch):
    """An engine core serving a front end in another process never reads it unless a structured output asks."""
    _, cache, _ = default_model
    monkeypatch.setenv("PAGEDLLM_CACHE", str(cache))
    info = load_model_info(None, weights=False)
    assert info._tokenizer_and_template is None
    assert "<|im_start|>" in info.chat_template
    assert info._tokenizer_and_template is not None and info.tokenizer is info._tokenizer_and_template[0]


def test_second_load_reads_the_cache(default_model, monkeypatch):
    loaded, cache, _ = default_model

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setenv("PAGEDLLM_CACHE", str(cache))
    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf_dir", must_not_convert)
    again = load_model(None)
    assert again.model_path == loaded.model_path


def test_logits_match_transformers(default_model, hf_reference, prompt_ids):
    loaded, _, _ = default_model
    ours = PagedRunner(loaded.model, num_blocks=16, block_size=16).step([(0, prompt_ids)])
    with torch.no_grad():
        ref = hf_reference(torch.tensor([prompt_ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)


def test_greedy_matches_transformers(default_model, hf_reference, prompt_ids):
    loaded, _, _ = default_model
    runner = PagedRunner(loaded.model, num_blocks=16, block_size=16)
    logits = runner.step([(0, prompt_ids)])
    ours = []
    for _ in range(8):
        ours.append(int(logits[-1].argmax()))
        logits = runner.step([(0, ours[-1:])])
    with torch.no_grad():
        ref = hf_reference.generate(
            torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt_ids) :].tolist()
    assert ours == ref
    # The GGUF's Q/K un-permutation is right only if the real model still answers sensibly.
    assert "Paris" in loaded.tokenizer.decode(ours)
