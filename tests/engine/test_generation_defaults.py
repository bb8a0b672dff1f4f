"""A model's sampling defaults (its generation_config.json, or the embedded model's card values) reach requests
that omit them; a request's own value wins; ``generation_config="vllm"`` turns them off."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.generation_defaults import (
    EMBEDDED_MODEL_DEFAULTS,
    read_generation_defaults,
    resolve_generation_defaults,
)
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
    from pagedllm.entrypoints.openai.http_intake import parse_model

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


def test_where_the_defaults_come_from(tmp_path):
    write_generation_config(tmp_path, temperature=0.6, top_p=0.95)
    assert resolve_generation_defaults("auto", str(tmp_path), tmp_path)[0] == {"temperature": 0.6, "top_p": 0.95}
    for off in ("vllm", "none", "VLLM"):
        assert resolve_generation_defaults(off, str(tmp_path), tmp_path)[0] == {}
    # the embedded model (model None): its converted directory has no sampling values, its card's apply
    converted = tmp_path / "converted"
    converted.mkdir()
    write_generation_config(converted)
    assert resolve_generation_defaults("auto", None, converted) == (
        {"temperature": 0.2, "top_p": 0.9}, "the embedded model's card (SmolLM2-135M-Instruct)")
    assert EMBEDDED_MODEL_DEFAULTS == {"temperature": 0.2, "top_p": 0.9}
    assert resolve_generation_defaults("vllm", None, converted)[0] == {}
    # a directory of its own, whatever the model ships
    assert resolve_generation_defaults(str(tmp_path), None, converted)[0] == {"temperature": 0.6, "top_p": 0.95}
    with pytest.raises(ValueError, match="generation_config must be auto, vllm, none or a directory"):
        resolve_generation_defaults(str(tmp_path / "missing"), None, converted)


def test_generation_config_vllm_turns_the_defaults_off(greedy_by_default_llm, tmp_path_factory):
    model_dir = greedy_by_default_llm.engine.engine_args.model
    off = LLM(model_dir, num_kv_blocks=16, generation_config="vllm")
    assert off.engine.generation_defaults == {}
    assert off.get_default_sampling_params().temperature == 1.0  # SamplingParams' own


def test_a_request_without_sampling_fields_reaches_the_engine_with_the_models_values(greedy_by_default_llm):
    """What the engine core received, not the text: the Request's SamplingParams."""
    engine = greedy_by_default_llm.engine
    engine.add_request("no-params", "Once upon a time")
    received = engine.core.scheduler.requests["no-params"].sampling_params  # the core's copy
    assert (received.temperature, received.repetition_penalty, received.top_p) == (0.0, 1.3, 1.0)
    engine.abort_request("no-params")
    engine.add_request("explicit", "Once upon a time", SamplingParams(temperature=0.7))
    assert engine.core.scheduler.requests["explicit"].sampling_params.temperature == 0.7
    assert engine.core.scheduler.requests["explicit"].sampling_params.repetition_penalty == 1.0
    engine.abort_request("explicit")


def test_cli_flags_over_the_models_defaults_over_greedy():
    from pagedllm.entrypoints.cli import _sampling_params, build_parser

    unset = build_parser().parse_args(["generate", "hi"])
    assert (_sampling_params(unset, {}).temperature, _sampling_params(unset, {}).top_p) == (0.0, 1.0)
    params = _sampling_params(unset, EMBEDDED_MODEL_DEFAULTS)
    assert (params.temperature, params.top_p) == (0.2, 0.9)
    given = build_parser().parse_args(["generate", "hi", "--temperature", "0.7", "--top-k", "5"])
    params = _sampling_params(given, EMBEDDED_MODEL_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, 5)
    engine_args = EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hi", "--generation-config", "vllm"]))
    assert engine_args.generation_config == "vllm"
