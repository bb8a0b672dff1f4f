"""A chat turn's answer as typed pieces, for the APIs built on the chat path (Responses, Messages).

The chat path's ChoiceParser (tools.py) splits a choice's text into OpenAI chat deltas: reasoning,
content, a call's header (id and name), its arguments in pieces. `pieces_of` turns those deltas into
`Piece`s in the order the model wrote them, so each API renders them as its own items or blocks,
streamed or whole, with the same parsers, grammars and tool formats as /v1/chat/completions.

    engine outputs ─► ChoiceParser.deltas ─► pieces_of ─► ResponseBuilder / MessageBuilder
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Union

from fastapi import Request

from pagedllm.entrypoints.openai.serving import IndexedOutputs, ServingContext, final_outputs
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.http_intake import parse_model
from pagedllm.entrypoints.openai.serving_chat import ChatTurn, start_chat
from pagedllm.entrypoints.openai.tools import ChoiceParser
from pagedllm.outputs import RequestOutput


@dataclass(slots=True)
class Piece:
    """One piece of an answer: reasoning or answer text, a call opened (id, name), or a call's arguments."""

    kind: Literal["reasoning", "text", "call", "arguments"]
    text: str = ""
    """The text (reasoning, text, arguments); the function name of a call."""
    call_id: str | None = None


@dataclass(slots=True)
class TurnEnd:
    """How a turn ended, and its token counts."""

    finish_reason: str | None
    """The engine's (stop, length, abort), or "tool_calls" when the answer made calls."""
    stop_reason: Union[str, int, None]
    """The stop string or token id that ended it, if any."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_reasoning_tokens: int = 0


def pieces_of(deltas: list[dict]) -> list[Piece]:
    """ChoiceParser deltas as Pieces, in order."""
    pieces = []
    for delta in deltas:
        if delta.get("reasoning_content"):
            pieces.append(Piece("reasoning", delta["reasoning_content"]))
        if delta.get("content"):
            pieces.append(Piece("text", delta["content"]))
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                pieces.append(Piece("call", call["function"]["name"], call["id"]))
            if call["function"].get("arguments"):
                pieces.append(Piece("arguments", call["function"]["arguments"]))
    return pieces


def chat_request(body: dict) -> ChatCompletionRequest:
    """A chat request built from another API's body; a 400 names the chat field at fault."""
    return parse_model(ChatCompletionRequest, body)


class TurnReader:
    """Reads one chat turn (n = 1) from the engine: pieces as they come, or all at once, then its end."""

    def __init__(self, ctx: ServingContext, turn: ChatTurn) -> None:
        self.ctx = ctx
        self.turn = turn
        self.parser = turn.parsers() if turn.parsers is not None else ChoiceParser(None, None)
        self._reasoning: list[str] = []

    @classmethod
    async def start(cls, ctx: ServingContext, raw_request: Request, request: ChatCompletionRequest,
                    request_id: str, max_tokens_is_ceiling: bool = False) -> TurnReader:
        return cls(ctx, await start_chat(request, raw_request, ctx, request_id, max_tokens_is_ceiling))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.turn.prompt_ids)

    def _pieces(self, text: str, final: bool) -> list[Piece]:
        pieces = pieces_of(self.parser.deltas(text, final))
        self._reasoning.extend(p.text for p in pieces if p.kind == "reasoning")
        return pieces

    def _end(self, output: RequestOutput, num_output_tokens: int) -> TurnEnd:
        c = output.outputs[0]
        reasoning = "".join(self._reasoning)
        tokenizer = self.ctx.engine.tokenizer
        # the parser splits text, not tokens: the reasoning's share is its text re-encoded
        num_reasoning = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning and tokenizer else 0
        return TurnEnd(self.parser.finish_reason(c.finish_reason), c.stop_reason, len(output.prompt_token_ids),
                       num_output_tokens, output.num_cached_tokens, min(num_reasoning, num_output_tokens))

    async def whole(self, raw_request: Request) -> tuple[list[Piece], TurnEnd]:
        """The whole answer (a client that disconnects meanwhile aborts it)."""
        (output,) = await final_outputs(raw_request, self.turn.streams)
        pieces = self._pieces(output.outputs[0].text, final=True)
        return pieces, self._end(output, len(output.outputs[0].token_ids))

    async def streamed(self, outputs: IndexedOutputs) -> AsyncIterator[Union[Piece, TurnEnd]]:
        """The pieces as the engine streams them, then the TurnEnd."""
        num_output_tokens = 0
        last = None
        async for _, output in outputs:
            c = output.outputs[0]
            num_output_tokens += len(c.token_ids)
            last = output
            for piece in self._pieces(c.text, final=c.finish_reason is not None):
                yield piece
        assert last is not None, "a stream ends with its final output"
        yield self._end(last, num_output_tokens)
