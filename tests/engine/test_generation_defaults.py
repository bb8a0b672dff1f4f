"""A model directory's generation_config.json sampling values reach requests that omit them; a
request's own value wins."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.generation_defaults import read_generation_defaults
from tests.engine.tiny_llama_dir import build_tiny_llama_dir


def write_generation_config(model_dir, **fields) -> None:
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **fields}))


def test_only_the_sampling_fields_are_read(tmp_path):
    write_generation_config(tmp_path, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=9, do_sample=True)
    assert read_generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_no_file_and_bad_values_give_no_defaults(tmp_path):
    assert read_generation_defaults(tmp_path) == {}
    assert read_generation_defaults(None) == {}
    write_generation_config(tmp_path, temperature="hot", top_p=True, min_p=0.1)
    assert read_generation_defaults(tmp_path) == {"min_p": 0.1}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_defaults(tmp_path) == {}


@pytest.fixture(scope="module")
def greedy_by_default_llm(tmp_path_factory):
    # Near-flat logits (the default init): a temperature-1 sample almost never follows the greedy path.
    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("gen-defaults"))
    write_generation_config(model_dir, temperature=0.0, repetition_penalty=1.3)
    return LLM(str(model_dir), num_kv_blocks=64)


def test_a_call_without_params_gets_the_models_defaults(greedy_by_default_llm):
    llm = greedy_by_default_llm
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.top_p) == (0.0, 1.3, 1.0)
    prompts = ["The capital of France is", "Once upon a time"]
    without = llm.generate(prompts, use_tqdm=False)
    explicit = llm.generate(prompts, SamplingParams(temperature=0.0, repetition_penalty=1.3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in explicit]
    sampled = llm.generate(prompts, SamplingParams(seed=0), use_tqdm=False)  # SamplingParams' own temperature 1
    assert [o.outputs[0].token_ids for o in without] != [o.outputs[0].token_ids for o in sampled]


def test_explicit_params_win(greedy_by_default_llm):
    llm = greedy_by_default_llm
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12)
    first = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert first == again  # seeded sampling at the request's temperature, not the model's 0
    assert first != greedy


def test_server_bodies_take_the_models_defaults_for_what_they_leave_out():
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagedllm.entrypoints.openai.request_body import parse_model

    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    chat = parse_model(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    params = chat.to_sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.6, 0.95, 20, 0.05, 1.1)
    explicit = parse_model(CompletionRequest, {"prompt": "x", "temperature": 1.0, "top_k": -1, "min_p": 0})
    params = explicit.to_sampling_params(defaults)
    assert (params.temperature, params.top_k, params.min_p, params.top_p) == (1.0, None, 0.0, 0.95)
    plain = parse_model(CompletionRequest, {"prompt": "x"}).to_sampling_params()  # no generation config: OpenAI's
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, None)
    beams = parse_model(CompletionRequest, {"prompt": "x", "use_beam_search": True, "n": 2, "best_of": 2})
    assert beams.to_sampling_params(defaults).temperature == 0.0  # beam search stays greedy
