"""Tool calling through a real `pagedllm serve` of the embedded SmolLM2-135M-Instruct and the official `openai`
client. SmolLM2's chat template takes no `tools`: they reach it as the hermes-style system prompt of
tools.py, which the checks below see through /tokenize. Forced calls (required, named) run under the grammar
built from the tools' schemas, so every argument validates (jsonschema) at temperature 1, streamed (through
the SDK's own accumulation) and not, with parallel_tool_calls true and false; `auto` is this small model's
free choice, so it is held only to the contract: calls that parse, or the text as content, never a 500.
Constrained calls stream their arguments in pieces; one the output ends inside (finish_reason length) keeps the
arguments written so far, as OpenAI's do. Requests that do not depend on each other are sent together, so the engine
batches them. The reasoning parser's server: test_tool_server_reasoning.py."""

from __future__ import annotations

import functools
import json

import httpx
import jsonschema
import openai
import pytest

from pagedllm.model.loader import resolve_hf_dir
from tests.entrypoints.server_helpers import RemoteServer, concurrently

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Zürich, and what is 2 + 3?"}]
MODEL = "smol"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer(resolve_hf_dir(None), ["--max-model-len", "2048", "--served-model-name", MODEL,
                                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                       tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _complete_calls(choice) -> list:
    """The calls of a choice that were finished: all of them, but the last when max_tokens cut the output inside it."""
    calls = choice.message.tool_calls or []
    return calls[:-1] if choice.finish_reason == "length" else calls


def _check_calls(calls, allowed: set[str], parallel: bool) -> None:
    assert calls, "a forced call returned none"
    if not parallel:
        assert len(calls) == 1
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    for c in calls:
        assert c.type == "function" and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


CHOICES = [("required", "required", {"get_weather", "add"}),
           ("named", {"type": "function", "function": {"name": "add"}}, {"add"})]


@pytest.fixture(scope="module")
def forced_responses(client) -> dict:
    """The forced-call response of each (tool choice label, parallel_tool_calls), all requested together."""
    cases = [(label, tool_choice, parallel) for label, tool_choice, _ in CHOICES for parallel in (True, False)]
    responses = concurrently(*[
        functools.partial(client.chat.completions.create, model=MODEL, messages=ASK, tools=TOOLS,
                          tool_choice=tool_choice, n=4, seed=11, temperature=1.0, max_tokens=300,
                          parallel_tool_calls=parallel)
        for _, tool_choice, parallel in cases])
    return {(label, parallel): r for (label, _, parallel), r in zip(cases, responses)}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("label,tool_choice,allowed", CHOICES, ids=[c[0] for c in CHOICES])
def test_forced_calls_validate_against_their_schemas(forced_responses, label, tool_choice, allowed, parallel):
    r = forced_responses[label, parallel]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls, allowed, parallel)
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("label,tool_choice,allowed", CHOICES, ids=[c[0] for c in CHOICES])
def test_streamed_calls_accumulate_in_the_sdk(client, label, tool_choice, allowed, parallel):
    """The SDK's own stream helper assembles the deltas (id and name first, then the arguments)."""
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, seed=5,
                                        temperature=1.0, max_tokens=300, parallel_tool_calls=parallel,
                                        stream_options={"include_usage": True}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _check_calls(choice.message.tool_calls, allowed, parallel)
    assert final.usage.completion_tokens > 0


def test_raw_stream_sends_id_and_name_before_arguments(server):
    """Per choice (n=2) and per call index: the first piece has id, type and name; the rest only arguments; the
    last chunk of each choice says tool_calls."""
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "stream": True, "seed": 1,
            "max_tokens": 300, "n": 2}
    pieces: dict[int, list] = {0: [], 1: []}
    num_argument_pieces: dict[tuple[int, int], int] = {}
    finish: dict[int, str] = {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    pieces[c["index"]] += c["delta"].get("tool_calls") or []
                    for tc in c["delta"].get("tool_calls") or []:
                        if tc["function"].get("arguments"):
                            key = (c["index"], tc["index"])
                            num_argument_pieces[key] = num_argument_pieces.get(key, 0) + 1
                    if c["finish_reason"]:
                        finish[c["index"]] = c["finish_reason"]
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for choice_pieces in pieces.values():
        first, arguments = {}, {}
        for tc in choice_pieces:
            if tc["index"] not in first:
                first[tc["index"]] = tc
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"] in SCHEMAS
                arguments[tc["index"]] = tc["function"]["arguments"]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                arguments[tc["index"]] += tc["function"]["arguments"]
        assert first and sorted(first) == list(range(len(first)))
        for index, text in arguments.items():
            jsonschema.validate(json.loads(text), SCHEMAS[first[index]["function"]["name"]])
    # constrained calls stream their arguments as the model writes them: several pieces per call
    assert min(num_argument_pieces.values()) > 1, num_argument_pieces


def test_tool_choice_none_answers_in_text(client, server):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", seed=2,
                                       max_tokens=24)
    (choice,) = r.choices
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # none leaves the tools out of the prompt
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}, timeout=30).json()["count"]
    assert r.usage.prompt_tokens == tokens


def test_a_history_with_tool_results_is_rendered_and_answered(client, server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_w", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Zürich", "unit": "celsius"}'}},
            {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_w", "content": "Sunny, 21 degrees"},
        {"role": "tool", "tool_call_id": "call_a", "content": "5"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=40)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # the prompt: SmolLM2's template takes no tools, so the fallback of tools.py wrote it
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    for piece in ('"name": "get_weather"', "<tools>", '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                  '"Zürich", "unit": "celsius"}}\n</tool_call>', "<tool_response>\nSunny, 21 degrees\n</tool_response>",
                  "<tool_response>\n5\n</tool_response>"):
        assert piece in prompt, prompt
    # and the model may call again after the results, under the grammar
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required", seed=3,
                                       max_tokens=300)
    _check_calls(r.choices[0].message.tool_calls, set(SCHEMAS), True)


def test_auto_returns_calls_or_text_never_a_500(client):
    """Under auto SmolLM2-135M mostly answers in text; whatever it writes, a call that does not parse is content."""
    num_calls = num_text = 0
    for r in concurrently(*[functools.partial(client.chat.completions.create, model=MODEL, messages=ASK, tools=TOOLS,
                                               tool_choice="auto", n=4, seed=seed, temperature=1.0, max_tokens=120)
                             for seed in range(3)]):
        for choice in r.choices:
            if choice.message.tool_calls:
                assert choice.finish_reason in ("tool_calls", "length")
                assert all(c.function.name in SCHEMAS for c in choice.message.tool_calls)
                for c in _complete_calls(choice):
                    assert isinstance(json.loads(c.function.arguments), dict)
                num_calls += 1
            else:
                assert isinstance(choice.message.content, str)
                num_text += 1
    assert num_calls + num_text == 12


def test_auto_constrains_an_opened_call_and_parallel_false(client):
    """With --tool-call-parser hermes, auto is free text until the model writes <tool_call>; from there the call is
    constrained, so every call that comes back validates, and parallel_tool_calls false allows one at most."""
    ask = [{"role": "user", "content": "Call get_weather for Zürich in celsius. Answer only with the tool call."}]
    num_calls = 0
    responses = concurrently(*[functools.partial(client.chat.completions.create, model=MODEL, messages=ask,
                                                  tools=TOOLS, tool_choice="auto", n=8, seed=9, temperature=1.0,
                                                  max_tokens=200, parallel_tool_calls=parallel)
                                for parallel in (True, False)])
    for parallel, r in zip((True, False), responses):
        for choice in r.choices:
            calls = choice.message.tool_calls or []
            if not parallel:
                assert len(calls) <= 1
            for c in _complete_calls(choice):
                jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
            if choice.finish_reason != "length":
                assert "<tool_call>" not in (choice.message.content or "")  # an opened call always completes
            num_calls += len(calls)
    print(f"auto: {num_calls} calls in 16 choices")


def test_auto_with_response_format_answers_in_the_format_or_calls(client):
    """OpenAI: response_format shapes the text answer, tools stay callable: the grammar is their union."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ADD}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", n=8, seed=4,
                                       temperature=1.0, max_tokens=200, response_format=fmt, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason in ("stop", "tool_calls"), choice
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls, set(SCHEMAS), False)
        else:
            jsonschema.validate(json.loads(choice.message.content), ADD)


def _param_of(error: openai.BadRequestError) -> str | None:
    return error.response.json()["error"]["param"]


@pytest.mark.parametrize("extra,messages,param,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "subtract"}}}, ASK, "tool_choice",
     "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, ASK, "tools.0.function.parameters", "\"object\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "required": "a"}}}]},
     ASK, "tools.0.function.parameters", "required"),
    ({"tool_choice": "required"}, ASK, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, ASK, "tools.0.function.name", "letters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, ASK, "response_format",
     "left out"),
    ({"tools": TOOLS, "tool_choice": "none"}, ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}],
     "messages.1.role", "tool message"),
    ({"tools": TOOLS, "tool_choice": "none"}, ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "1"}], "messages.2.tool_call_id", "'c2'"),
    ({"tools": TOOLS, "tool_choice": "none"}, ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "user", "content": "and?"}], "messages.1.tool_calls", "answered"),
])
def test_tool_errors_are_400s_naming_the_field(client, extra, messages, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **extra)
    assert _param_of(info.value) == param and words in info.value.response.json()["error"]["message"], \
        info.value.response.text


def test_no_blocks_leak(server):
    server.wait_idle_without_leaks()

