"""The Responses and Messages APIs' parts that need no server: the bounded store (exact LRU order, bytes,
keys), the event builders over interleaved reasoning, text and calls, and the translation of each API's
conversation into chat messages."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.anthropic import protocol as anthropic_protocol
from pagedllm.entrypoints.anthropic.serving_messages import MessageBuilder, stop_reason
from pagedllm.entrypoints.openai.chat_turn import Piece, TurnEnd, pieces_of
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.responses_output import ResponseBuilder, output_as_items
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, chat_messages, truncated
from pagedllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.tools import ChoiceParser


def entry(response_id: str, text: str = "") -> StoredResponse:
    return StoredResponse({"id": response_id, "text": text}, [], [])


class Observer:
    def __init__(self) -> None:
        self.reports = []

    def record_store(self, num_entries, num_bytes, num_evicted) -> None:
        self.reports.append((num_entries, num_bytes, num_evicted))


def test_store_evicts_least_recently_used_by_count():
    observer = Observer()
    store = ResponseStore(max_entries=3, max_bytes=10**6, observer=observer)
    for name in "abc":
        assert store.put("k", entry(name))
    assert store.get("k", "a") is not None  # a is now the most recent: b goes first
    store.put("k", entry("d"))
    assert store.get("k", "b") is None and [store.get("k", n) is not None for n in "acd"] == [True] * 3
    store.put("k", entry("e"))
    assert store.get("k", "a") is None  # the gets above left the order a, c, d: a goes
    assert len(store) == 3 and store.num_evicted == 2 and observer.reports[-1][::2] == (3, 2)
    assert observer.reports[-1][1] == store.num_bytes


def test_store_bounds_bytes_and_scopes_keys():
    one = len(json.dumps([{"id": "a", "text": "x" * 100}, [], []], separators=(",", ":")))
    store = ResponseStore(max_entries=100, max_bytes=2 * one + 5)
    assert store.put("k1", entry("a", "x" * 100)) and store.put("k1", entry("b", "x" * 100))
    assert store.num_bytes == 2 * one
    store.put("k1", entry("c", "x" * 100))
    assert store.get("k1", "a") is None and store.num_bytes == 2 * one and store.num_evicted == 1
    assert not store.put("k1", entry("huge", "x" * 1000))  # alone past the bound: not stored, nothing evicted
    assert len(store) == 2
    assert store.get("k2", "b") is None and store.get(None, "b") is None  # another key's, or no key's
    assert not store.delete("k2", "b") and store.delete("k1", "b") and store.get("k1", "b") is None
    assert store.num_bytes == one
    assert not ResponseStore(0, 10**6).put("k", entry("a"))
    with pytest.raises(ValueError):
        ResponseStore(-1, 10)


def _end(finish="stop", **kw) -> TurnEnd:
    return TurnEnd(finish, None, 10, 7, 0, **kw)


def test_response_builder_interleaved_items():
    b = ResponseBuilder("resp_1", "m", {})
    events = b.start()
    for piece in [Piece("reasoning", "think "), Piece("reasoning", "more"), Piece("text", "Hi"),
                  Piece("call", "add", "call_1"), Piece("arguments", '{"a": '), Piece("arguments", "1}"),
                  Piece("call", "add", "call_2"), Piece("arguments", "{}"), Piece("text", "done")]:
        events += b.add(piece)
    events += b.finish(_end("tool_calls", num_reasoning_tokens=2))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done", "completed"]
    # an item is announced empty and done whole; every item is closed before the next opens
    assert events[2]["item"]["content"] == [] and events[8]["item"]["content"][0]["text"] == "think more"
    out = b.response["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call", "function_call", "message"]
    assert out[2]["arguments"] == '{"a": 1}' and out[2]["call_id"] == "call_1" and out[3]["arguments"] == "{}"
    assert all(i["status"] == "completed" for i in out) and b.response["status"] == "completed"
    assert b.response["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                                   "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 2},
                                   "total_tokens": 17}
    assert output_as_items(out) == [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]


def test_response_builder_incomplete_and_failed():
    b = ResponseBuilder("resp_1", "m", {})
    b.add(Piece("text", "cut"))
    events = b.finish(_end("length"))
    assert events[-1]["type"] == "response.incomplete" and b.response["output"][0]["status"] == "incomplete"
    assert b.response["incomplete_details"] == {"reason": "max_output_tokens"}
    b = ResponseBuilder("resp_2", "m", {})
    b.add(Piece("text", "cut"))
    events = b.fail("server_error", "boom")
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["message"] == "boom"
    assert events[-2]["type"] == "response.output_item.done"


def test_reasoning_parser_pieces_reach_both_builders():
    """The chat path's reasoning parser splits the text; each API renders the split its way."""
    parser = ChoiceParser(None, "qwen3")
    pieces = pieces_of(parser.deltas("<think>Two plus two.</think>", final=False))
    pieces += pieces_of(parser.deltas("\n\nFour.", final=True))
    assert [(p.kind, p.text) for p in pieces] == [("reasoning", "Two plus two."), ("text", "Four.")]
    rb, mb = ResponseBuilder("resp", "m", {}), MessageBuilder("msg", "m", 5)
    for p in pieces:
        rb.add(p)
        mb.add(p)
    rb.finish(_end())
    mb.finish(_end(), None)
    assert [i["type"] for i in rb.response["output"]] == ["reasoning", "message"]
    assert rb.response["output"][0]["content"] == [{"type": "reasoning_text", "text": "Two plus two."}]
    assert mb.message["content"] == [{"type": "thinking", "thinking": "Two plus two.", "signature": ""},
                                     {"type": "text", "text": "Four."}]


def test_message_builder_events_and_stop_reasons():
    b = MessageBuilder("msg_1", "m", 12)
    events = b.start()
    for piece in [Piece("text", "Let me add."), Piece("call", "add", "call_1"), Piece("arguments", '{"a": 1,'),
                  Piece("arguments", ' "b": 2}')]:
        events += b.add(piece)
    events += b.finish(_end("tool_calls"), None)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": 12, "output_tokens": 0}
    assert events[5] == {"type": "content_block_start", "index": 1,
                         "content_block": {"type": "tool_use", "id": "call_1", "name": "add", "input": {}}}
    assert events[6]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1,'}
    assert b.message["content"][1]["input"] == {"a": 1, "b": 2} and b.message["stop_reason"] == "tool_use"
    assert events[-2]["usage"] == {"output_tokens": 7}
    cut = MessageBuilder("msg_2", "m", 1)
    cut.add(Piece("call", "add", "call_1"))
    cut.add(Piece("arguments", '{"a": '))
    assert cut.finish(_end("length"), None)[0] == {"type": "content_block_stop", "index": 0}
    assert cut.message["content"][0]["input"] == {} and cut.message["stop_reason"] == "max_tokens"
    assert stop_reason(TurnEnd("stop", "END", 1, 1, 0), ["END"]) == ("stop_sequence", "END")
    assert stop_reason(TurnEnd("stop", 2, 1, 1, 0), ["END"]) == ("end_turn", None)


def test_responses_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add "},
                                                              {"type": "input_text", "text": "1 and 2"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":1,"b":2}'},
             {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "3"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "0"}]}]
    assert chat_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}, {"role": "tool", "tool_call_id": "c2", "content": "0"}]
    with pytest.raises(APIError, match="input.0.content.0"):
        chat_messages([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(APIError, match="input.0.type"):
        chat_messages([{"type": "item_reference", "id": "x"}])
    body = ResponsesRequest(input="Hi", instructions="Sys", max_output_tokens=5, top_k=3, unknown=1,
                            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                            tool_choice={"type": "function", "name": "f"}).chat_body([{"role": "user", "content": "Hi"}])
    assert body["messages"][0] == {"role": "system", "content": "Sys"} and body["max_completion_tokens"] == 5
    assert body["top_k"] == 3 and "unknown" not in body
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}


def test_truncation_drops_oldest_turns():
    items = [{"role": "system", "content": "S"}, {"role": "user", "content": "1"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "2"},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c", "output": "x"}, {"role": "user", "content": "3"}]
    once = truncated(items)
    assert once == [items[0], *items[3:]]
    assert truncated(once) == [items[0], items[6]]
    assert truncated([items[0], items[6]]) is None


def test_anthropic_messages_become_chat_messages():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Add 1 and 2"}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                  {"type": "text", "text": "Sure."},
                                                  {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "3"}]},
                                             {"type": "text", "text": "Thanks"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "add", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                              "content": "bad"}]}]
    assert anthropic_protocol.chat_messages(messages) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "3"}, {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: bad"}]
    request = anthropic_protocol.MessagesRequest(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "Hi"}], system=[{"type": "text", "text": "S"}],
        stop_sequences=["END"], top_k=2, tools=[{"name": "f", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    body = request.chat_body()
    assert body["messages"][0] == {"role": "system", "content": "S"} and body["stop"] == ["END"]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False and body["top_k"] == 2
    with pytest.raises(APIError, match="tools.0.type"):
        anthropic_protocol.chat_tool({"type": "web_search_20250305", "name": "web_search"}, 0)
    with pytest.raises(APIError, match="messages.0.content.0.type"):
        anthropic_protocol.chat_messages([{"role": "user", "content": [{"type": "image", "source": {}}]}])
