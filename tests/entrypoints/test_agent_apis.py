"""OpenAI's Responses API and Anthropic's Messages API through a real `pagedllm serve` of the embedded
SmolLM2-135M-Instruct, driven by the official `openai` and `anthropic` SDKs (and plain HTTP where an SDK
refuses to send what is tested). One server, auth on with two keys, a response store of 4 entries.
Greedy text through each API equals /v1/chat/completions' for the same conversation; forced tool calls
(grammar-constrained) validate against their schemas; a client that disconnects aborts its request."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from pagedllm.model.loader import resolve_hf_dir
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-a", "key-b"
MODEL = "smol"
STORE_ENTRIES = 4
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD,
                    "strict": True}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "Add two integers", "input_schema": ADD}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer(resolve_hf_dir(None), [
        "--max-model-len", "2048", "--served-model-name", MODEL, "--enable-auto-tool-choice",
        "--api-key", KEY_A, "--api-key", KEY_B, "--responses-store-max-entries", str(STORE_ENTRIES)],
        tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY_A, max_retries=0, timeout=120)


def chat_text(oai, messages: list[dict], max_tokens: int) -> str:
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content


def aborted(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^pagedllm_request_success_total\{[^}]*finish_reason="abort"[^}]*\} (\S+)',
                                            text, re.M))


# ---- Responses ----

def test_responses_greedy_equals_chat(oai):
    r = oai.responses.create(model=MODEL, instructions="Answer briefly.", input="Name a colour.",
                             max_output_tokens=24, **GREEDY)
    expected = chat_text(oai, [{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "Name a colour."}], 24)
    assert r.output_text == expected and expected
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # input as a list of items, content as parts, reaches the same conversation
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]
    r = oai.responses.create(model=MODEL, input=items, max_output_tokens=24, **GREEDY)
    assert r.output_text == expected
    # a chain continues the conversation (input items are carried, instructions are not, as OpenAI's): its
    # prompt extends the first one's, found in the prefix cache
    nxt = oai.responses.create(model=MODEL, previous_response_id=r.id, input="And another?", max_output_tokens=4)
    assert nxt.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens - 1
    assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens // 2


def test_responses_stream_events(oai):
    events = list(oai.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=16,
                                       stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 16 tokens cut it: max_output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 16
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text
    assert text == chat_text(oai, [{"role": "user", "content": "Count from one to five."}], 16)


def test_responses_function_call_round_trip(oai, server):
    ask = "What is 2 + 3? Use the tool."
    r = oai.responses.create(model=MODEL, input=ask, tools=RESPONSES_TOOLS, parallel_tool_calls=False,
                             tool_choice={"type": "function", "name": "add"}, max_output_tokens=60, **GREEDY)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD)
    result = sum(json.loads(call.arguments).values())
    r2 = oai.responses.create(model=MODEL, previous_response_id=r.id, tools=RESPONSES_TOOLS, tool_choice="none",
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": str(result)}],
                              max_output_tokens=30, **GREEDY)
    assert r2.output[0].type == "message" and r2.output_text and r2.previous_response_id == r.id
    # the chain rebuilt the conversation: the same text as chat with the whole history
    history = [{"role": "user", "content": ask},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": str(result)}]
    chat = oai.chat.completions.create(model=MODEL, messages=history, tools=[
        {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}],
        tool_choice="none", max_tokens=30, **GREEDY)
    assert r2.output_text == chat.choices[0].message.content
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    items = oai.responses.input_items.list(r2.id, order="asc").data
    assert [i.type for i in items] == ["function_call_output"] and items[0].call_id == call.call_id


def test_responses_streamed_call_arguments(oai):
    with oai.responses.stream(model=MODEL, input="Add 4 and 9.", tools=RESPONSES_TOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=60, **GREEDY) as stream:
        events = list(stream)
        accumulated = stream.get_final_response()  # the SDK's own accumulation of the events
    assert accumulated.output[0].arguments == events[-1].response.output[0].arguments
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (item,) = events[-1].response.output
    assert deltas == done.arguments == item.arguments and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), ADD)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_json_schema(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="Invent a person.", max_output_tokens=80, temperature=1.0,
                             text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_response_store_is_bounded_and_per_key(oai, server):
    ids = [oai.responses.create(model=MODEL, input=f"Say {i}.", max_output_tokens=1).id for i in range(STORE_ENTRIES + 1)]
    with pytest.raises(openai.NotFoundError):  # the least recently used went first
        oai.responses.retrieve(ids[0])
    assert oai.responses.retrieve(ids[-1]).id == ids[-1]
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(ids[-1])
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="Go on.", previous_response_id=ids[-1], max_output_tokens=1)
    m = server.metrics()
    assert m["pagedllm_responses_store_entries"] == STORE_ENTRIES and m["pagedllm_responses_store_evictions_total"] >= 1
    assert m["pagedllm_responses_store_bytes"] > 0
    unstored = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    oai.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(ids[-1])
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(ids[-1])


def test_responses_bad_input_is_400(oai):
    with pytest.raises(openai.BadRequestError, match="input.0.content.0"):
        oai.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])
    with pytest.raises(openai.BadRequestError, match="tools.0.type"):
        oai.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])


BAD_RESPONSES = [{}, {"input": 3}, {"input": []}, {"input": [{"role": "user"}]}, {"input": [{"role": "tool", "content": "x"}]},
                 {"input": [{"type": "function_call", "call_id": 1, "name": "f"}]},
                 {"input": [{"type": "function_call_output", "output": "x"}]},
                 {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
                 {"input": "Hi", "tools": [{"type": "function"}]}, {"input": "Hi", "tool_choice": {"type": "x"}},
                 {"input": "Hi", "tool_choice": "required"}, {"input": "Hi", "metadata": {"k": 1}},
                 {"input": "Hi", "max_output_tokens": 0}, {"input": "Hi", "temperature": -1},
                 {"input": "Hi", "text": {"format": {"type": "json_schema"}}}, {"input": "Hi", "truncation": "x"},
                 {"input": "Hi", "previous_response_id": "resp_nope"}]
BAD_MESSAGES = [{"max_tokens": 4}, {"max_tokens": 4, "messages": []}, {"max_tokens": 0, "messages": [{"role": "user",
                                                                                                     "content": "x"}]},
                {"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
                {"max_tokens": 4, "messages": [{"role": "user", "content": [3]}]},
                {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
                {"max_tokens": 4, "messages": [{"role": "user", "content": None}]},
                {"max_tokens": 4, "system": [{"type": "image"}], "messages": [{"role": "user", "content": "x"}]},
                {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
                {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "x"}},
                {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
                {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "output_config": {"format": 1}}]


@pytest.mark.parametrize("path,body", [("/v1/responses", b) for b in BAD_RESPONSES] +
                         [("/v1/messages", b) for b in BAD_MESSAGES])
def test_bad_bodies_are_4xx_naming_the_problem(server, path, body):
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=30,
                   headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code in (400, 404), (body, r.text)
    error = r.json()["error"]
    assert error["message"] and (error["type"] == ("not_found_error" if r.status_code == 404 else
                                                   "invalid_request_error")), r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error"


# ---- Messages ----

def test_messages_greedy_equals_chat_with_system_inside(claude, oai):
    m = claude.messages.create(model=MODEL, max_tokens=24, system="Answer briefly.", extra_body=GREEDY,
                               messages=[{"role": "system", "content": "Be kind."},
                                         {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}])
    expected = chat_text(oai, [{"role": "system", "content": "Answer briefly."}, {"role": "system", "content": "Be kind."},
                               {"role": "user", "content": "Name a fruit."}], 24)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24


def test_messages_stream_accumulates(claude, oai):
    kinds = []
    with claude.messages.stream(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Count from one to five."}]) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == chat_text(oai, [{"role": "user", "content": "Count from one to five."}], 16)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16


def test_messages_tool_use_round_trip(claude):
    ask = {"role": "user", "content": "What is 2 + 3? Use the tool."}
    with claude.messages.stream(model=MODEL, max_tokens=80, tools=ANTHROPIC_TOOLS, extra_body=GREEDY, messages=[ask],
                                tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True}) as s:
        m = s.get_final_message()
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "add" and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, ADD)
    whole = claude.messages.create(model=MODEL, max_tokens=80, tools=ANTHROPIC_TOOLS, extra_body=GREEDY,
                                   messages=[ask], tool_choice={"type": "tool", "name": "add",
                                                                "disable_parallel_tool_use": True})
    assert whole.content[0].input == use.input  # streamed and whole agree
    answer = claude.messages.create(model=MODEL, max_tokens=30, tools=ANTHROPIC_TOOLS, extra_body=GREEDY, messages=[
        ask, {"role": "assistant", "content": [{"type": "text", "text": "Let me add."}, use.model_dump(
            include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": str(sum(use.input.values()))}]}]}],
        tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_messages_output_format_json_schema(claude):
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["fruit", "count"], "additionalProperties": False}
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Pick a fruit."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert m.stop_reason == "end_turn"


def test_messages_count_tokens(claude, server):
    messages = [{"role": "user", "content": "Hello there"}]
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages).input_tokens
    expected = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30,
                          json={"messages": [{"role": "system", "content": "Be brief."}, *messages]}).json()["count"]
    assert counted == expected > 0
    m = claude.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=messages)
    assert m.usage.input_tokens == counted


def test_messages_errors_in_anthropic_shape(server):
    url = f"{server.url}/v1/messages"
    r = httpx.post(url, headers={"x-api-key": KEY_A}, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(url, headers={"x-api-key": "wrong"}, timeout=30, json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    r = httpx.post(url, headers={"x-api-key": KEY_A}, timeout=30, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert r.status_code == 400 and "messages.0.content.0.type" in r.json()["error"]["message"]
    r = httpx.post(url, headers={"x-api-key": KEY_A}, timeout=30,
                   json={"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# ---- disconnects ----

@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "Tell me everything.", "max_output_tokens": 1500, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 1500,
                      "stream": True}),
], ids=["responses", "messages"])
def test_disconnect_mid_stream_aborts(server, path, body):
    before = aborted(server)
    with httpx.stream("POST", f"{server.url}{path}", json={"model": MODEL, "ignore_eos": True, **body},
                      headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held open: leaving a loop over it would close the connection
        num_deltas = 0
        while num_deltas < 5:  # a few tokens in, so the request runs in the engine
            line = next(lines)
            num_deltas += line.startswith("data:") and '"delta"' in line
        assert server.metrics()["pagedllm_num_requests_running"] == 1
    start = time.monotonic()
    server.wait_idle_without_leaks(timeout_s=15)  # every KV block free, far sooner than 1500 tokens
    assert time.monotonic() - start < 15
    assert aborted(server) == before + 1


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "Tell me everything.", "max_output_tokens": 1500}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 1500}),
], ids=["responses", "messages"])
def test_disconnect_while_waiting_aborts(server, path, body):
    before = aborted(server)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up on a whole answer
        httpx.post(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY_A}"},
                   json={"model": MODEL, "ignore_eos": True, **body}, timeout=httpx.Timeout(60, read=1.0))
    server.wait_idle_without_leaks(timeout_s=15)
    assert aborted(server) == before + 1


def test_responses_truncation_auto_drops_oldest_turns(oai):
    long_turn = "Here is a long note about rivers. " * 320  # ~2600 tokens: past max_model_len (2048) alone
    items = [{"role": "user", "content": long_turn}, {"role": "assistant", "content": "Noted."},
             {"role": "user", "content": "Name a river."}]
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        oai.responses.create(model=MODEL, input=items, max_output_tokens=8)
    r = oai.responses.create(model=MODEL, input=items, max_output_tokens=8, truncation="auto", **GREEDY)
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    # what is left is the last turn: the same text as chat gives for it alone
    assert r.output_text == chat_text(oai, [{"role": "user", "content": "Name a river."}], 8)


def test_messages_claude_code_shaped_request(server):
    """The body Claude Code sends (captured from its 2.1 release): max_tokens far past this server's 2048-token
    context, adaptive thinking, context_management, output_config.effort, cache_control on system blocks and
    `?beta=true`. The max_tokens is a ceiling, so the answer is a 200 stream, not a 400."""
    body = {"model": MODEL, "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "u"}, "stop_sequences": [" ", "\n"],
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "Bash", "description": "execute shell commands", "input_schema": {
                "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                "properties": {"command": {"type": "string"}}, "required": ["command"]}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello.",
                                                       "cache_control": {"type": "ephemeral"}}]}]}
    with httpx.stream("POST", f"{server.url}/v1/messages?beta=true", json=body, timeout=60,
                      headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01",
                               "anthropic-beta": "claude-code-20250219"}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "error" not in kinds, kinds
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] in ("end_turn", "stop_sequence", "tool_use", "max_tokens"), delta
