"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The answer's pieces (chat_turn.py) become content blocks: thinking (from the reasoning parser), text,
tool_use (from the tool parser, `input` the parsed arguments). Streamed, as Anthropic's:

    message_start, ping,
    per block: content_block_start, content_block_delta (thinking_delta | text_delta | input_json_delta)...,
               content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

Every block is closed and message_stop sent even when the output ends inside a call (stop_reason
max_tokens), so no client waits on an open tool_use block. Errors, before or during a stream, are in
Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.chat_turn import Piece, TurnEnd, TurnReader, chat_request
from pagedllm.entrypoints.openai.serving import IndexedOutputs, ServingContext, SSEResponse, named_sse_event, new_id
from pagedllm.entrypoints.openai.errors import api_error_from
from pagedllm.entrypoints.openai.serving_chat import apply_chat_template
from pagedllm.entrypoints.openai.tools import ToolPlan


def stop_reason(end: TurnEnd, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the output, if one did)."""
    if end.finish_reason == "tool_calls":
        return "tool_use", None
    if end.finish_reason == "length":
        return "max_tokens", None
    if isinstance(end.stop_reason, str) and end.stop_reason in (stop_sequences or ()):
        return "stop_sequence", end.stop_reason
    return "end_turn", None


def _parsed_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:  # cut off by max_tokens: what was written is not JSON yet
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """Builds one message; `add` and `finish` return the stream events of each step."""

    def __init__(self, message_id: str, model: str, num_input_tokens: int) -> None:
        self.message: dict[str, Any] = {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": num_input_tokens, "output_tokens": 0}}
        self._open: dict | None = None
        self._arguments = ""

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": json.loads(json.dumps(self.message))}, {"type": "ping"}]

    def add(self, piece: Piece) -> list[dict]:
        kind = {"reasoning": "thinking", "text": "text", "call": "tool_use"}.get(piece.kind)
        events: list[dict] = []
        if kind is not None and (self._open is None or self._open["type"] != kind or kind == "tool_use"):
            events += self._close()
            events += self._open_block(kind, piece)
        index = len(self.message["content"]) - 1
        block = self._open
        if piece.kind == "reasoning":
            block["thinking"] += piece.text
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "thinking_delta", "thinking": piece.text}})
        elif piece.kind == "text":
            block["text"] += piece.text
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "text_delta", "text": piece.text}})
        elif piece.kind == "arguments" and block is not None and block["type"] == "tool_use":
            self._arguments += piece.text
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": piece.text}})
        return events

    def _open_block(self, kind: str, piece: Piece) -> list[dict]:
        if kind == "tool_use":
            block = {"type": "tool_use", "id": piece.call_id, "name": piece.text, "input": {}}
            self._arguments = ""
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        self.message["content"].append(block)
        self._open = block
        return [{"type": "content_block_start", "index": len(self.message["content"]) - 1, "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _parsed_input(self._arguments)
        return [{"type": "content_block_stop", "index": len(self.message["content"]) - 1}]

    def finish(self, end: TurnEnd, stop_sequences: list[str] | None) -> list[dict]:
        events = self._close()
        reason, sequence = stop_reason(end, stop_sequences)
        self.message.update(stop_reason=reason, stop_sequence=sequence)
        self.message["usage"] = {"input_tokens": end.num_prompt_tokens, "output_tokens": end.num_output_tokens}
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": {"output_tokens": end.num_output_tokens}},
                         {"type": "message_stop"}]


async def create_message(request: MessagesRequest, raw_request: Request, ctx: ServingContext):
    chat = chat_request(request.chat_body())
    message_id = new_id("msg").replace("-", "_")
    reader = await TurnReader.start(ctx, raw_request, chat, message_id, max_tokens_is_ceiling=True)
    builder = MessageBuilder(message_id, reader.turn.model, reader.num_prompt_tokens)
    if request.stream:
        return SSEResponse(reader.turn.streams, lambda outputs: _events(reader, builder, request, outputs),
                           frame=named_sse_event, done=False)
    pieces, end = await reader.whole(raw_request)
    for piece in pieces:
        builder.add(piece)
    builder.finish(end, request.stop_sequences)
    return JSONResponse(builder.message)


async def _events(reader: TurnReader, builder: MessageBuilder, request: MessagesRequest,
                  outputs: IndexedOutputs) -> AsyncIterator[dict]:
    for event in builder.start():
        yield event
    try:
        async for piece in reader.streamed(outputs):
            if isinstance(piece, TurnEnd):
                for event in builder.finish(piece, request.stop_sequences):
                    yield event
                return
            for event in builder.add(piece):
                yield event
    except Exception as e:  # noqa: BLE001 - a failure mid-stream is an error event, as Anthropic's
        error = api_error_from(e)
        error.anthropic = True
        yield error.body()


def add_messages_routes(app: FastAPI, ctx: ServingContext, body, require_engine) -> None:
    """Register /v1/messages and /v1/messages/count_tokens; every error is in Anthropic's shape."""

    async def anthropic_errors(handler):
        try:
            return await handler()
        except Exception as e:  # noqa: BLE001 - each becomes its status in Anthropic's shape
            error = api_error_from(e)
            error.anthropic = True
            return error.response()

    @app.post("/v1/messages")
    async def messages(raw_request: Request):
        async def handle():
            require_engine()
            request = await body(raw_request, MessagesRequest)
            return await create_message(request, raw_request, ctx)
        return await anthropic_errors(handle)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request):
        async def handle():
            request = await body(raw_request, CountTokensRequest)
            chat = chat_request(request.chat_body())
            ctx.check_model(chat.model)
            engine = ctx.engine
            plan = ToolPlan(ctx.config.tool_call_parser, chat.tools, chat.tools, None) if chat.tools else None
            ids = await engine.run_blocking(apply_chat_template, engine.tokenizer, chat.messages, True, plan)
            return JSONResponse({"input_tokens": len(ids)})
        return await anthropic_errors(handle)
