"""A Responses API answer built from a chat turn's pieces (chat_turn.py): its output items, and the
stream events that build them, each numbered by `sequence_number`.

    response.created, response.in_progress
    per item:  response.output_item.added
               reasoning  content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
               message    content_part.added, output_text.delta..., output_text.done, content_part.done
               call       function_call_arguments.delta..., function_call_arguments.done
               response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

An item is opened when its first piece arrives and closed when a piece of another kind (or the end)
does, so reasoning, text and calls may interleave and every item is still closed before the next opens.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from pagedllm.entrypoints.openai.chat_turn import Piece, TurnEnd
from pagedllm.entrypoints.openai.serving import now_s


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(end: TurnEnd) -> dict:
    return {"input_tokens": end.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": end.num_cached_tokens},
            "output_tokens": end.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": end.num_reasoning_tokens},
            "total_tokens": end.num_prompt_tokens + end.num_output_tokens}


class ResponseBuilder:
    """Builds one response object; `add` and `finish` return the stream events of each step."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any]) -> None:
        self.response: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": now_s(), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None, "usage": None, **echo}
        self._open: dict | None = None
        self._seq = 0

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict]:
        snapshot = copy.deepcopy(self.response)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def add(self, piece: Piece) -> list[dict]:
        kind = {"reasoning": "reasoning", "text": "message", "call": "function_call"}.get(piece.kind)
        events: list[dict] = []
        if kind is not None and (self._open is None or self._open["type"] != kind or kind == "function_call"):
            events += self._close("completed")
            events += self._open_item(kind, piece)
        item = self._open
        index = len(self.output) - 1
        if piece.kind == "reasoning":
            item["content"][0]["text"] += piece.text
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=piece.text))
        elif piece.kind == "text":
            item["content"][0]["text"] += piece.text
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=piece.text, logprobs=[]))
        elif piece.kind == "arguments" and item is not None and item["type"] == "function_call":
            item["arguments"] += piece.text
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=piece.text))
        return events

    def _open_item(self, kind: str, piece: Piece) -> list[dict]:
        if kind == "function_call":
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece.call_id,
                    "name": piece.text, "arguments": ""}
        elif kind == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": []}
        else:
            item = {"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))]
        if kind != "function_call":
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self._event(done, item_id=item["id"], output_index=index, content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        return events

    def finish(self, end: TurnEnd) -> list[dict]:
        """Close the open item and complete the response (incomplete when max_output_tokens cut it)."""
        incomplete = end.finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        self.response["usage"] = response_usage(end)
        if incomplete:
            self.response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            return events + [self._event("response.incomplete", response=copy.deepcopy(self.response))]
        self.response.update(status="completed", completed_at=now_s())
        return events + [self._event("response.completed", response=copy.deepcopy(self.response))]

    def fail(self, code: str, message: str) -> list[dict]:
        """End the stream with response.failed (the items so far closed as incomplete)."""
        events = self._close("incomplete")
        self.response.update(status="failed", error={"code": code, "message": message})
        return events + [self._event("response.failed", response=copy.deepcopy(self.response))]


def output_as_items(output: list[dict]) -> list[dict]:
    """A response's output items as the input items of the next turn."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": part["text"]} for part in item["content"]]})
        elif item["type"] == "function_call":
            items.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"]})
    return items
