"""POST /v1/chat/completions: messages through the model's chat template, answers or SSE deltas.

With tools or a reasoning parser each choice's text goes through a ChoiceParser (tools.py): the
message gets reasoning_content and tool_calls, and a stream sends them as OpenAI's deltas do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.chat import ChatMessage, ChatTemplateError, render_chat
from pagedllm.entrypoints.openai.serving import (
    IndexedOutputs,
    ServingContext,
    SSEResponse,
    final_outputs,
    new_id,
    now_s,
    open_streams,
)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tools import ChoiceParser, ToolPlan, conversation, prepare_tools, template_takes_tools
from pagedllm.outputs import CompletionOutput, Logprob, LogprobsDict, RequestOutput


def apply_chat_template(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                        plan: ToolPlan | None = None, chat_template: str | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the conversation through the chat template (the tokenizer's, or ``chat_template``), in the
    sandbox and under the budget of entrypoints/chat.py, with the plan's tools (natively or in the fallback of
    tools.py); 400 if it cannot be applied."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    if plan is not None or any(m.tool_calls or m.role == "tool" for m in messages):
        turns, tools = conversation(messages, plan, "tools" in chat_template if chat_template
                                    else template_takes_tools(tokenizer))
    else:  # no tool in the request or its history: the messages as they are
        turns, tools = [m.turn() for m in messages], None
    param = "chat_template" if chat_template else "messages"
    try:
        return render_chat(tokenizer, turns, tools=tools, add_generation_prompt=add_generation_prompt,
                           chat_template=chat_template, template_kwargs=template_kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param=param) from None
    except Exception as e:  # template errors (e.g. a role it refuses, a sandbox refusal) are the request's fault
        raise APIError(400, f"the chat template cannot be applied to these messages: {e}", param=param) from None


def _request_template(request: ChatCompletionRequest, trusted: bool) -> tuple[str | None, dict | None]:
    """The request's own chat_template and chat_template_kwargs, which only a server that trusts them takes."""
    for field in ("chat_template", "chat_template_kwargs"):
        if getattr(request, field) is not None and not trusted:
            raise APIError(400, f"{field} in a request is not accepted by this server (start it with "
                                "--trust-request-chat-template to allow it)", param=field)
    return request.chat_template, request.chat_template_kwargs


def top_entries(entry: LogprobsDict, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely candidates of one position, most likely first."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].logprob, reverse=True)[:k]


def _token_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[LogprobsDict], num_top: int) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        token = chosen.decoded_token if chosen and chosen.decoded_token is not None else \
            (tokenizer.decode([token_id]) if tokenizer is not None else "")
        item = _token_entry(token, chosen.logprob if chosen else float("-inf"))
        item["top_logprobs"] = [_token_entry(lp.decoded_token or "", lp.logprob) for _, lp in top_entries(entry, num_top)]
        content.append(item)
    return {"content": content}


def _logprobs(ctx: ServingContext, request: ChatCompletionRequest, completion: CompletionOutput) -> dict | None:
    if not request.logprobs:
        return None
    return chat_logprobs(ctx.engine.tokenizer, list(completion.token_ids), list(completion.logprobs or []),
                         request.top_logprobs or 0)


@dataclass(slots=True)
class ChatTurn:
    """A chat request queued in the engine: what the endpoints built on chat (chat completions, Responses,
    Messages) need to render its answer."""

    request_id: str
    model: str
    prompt_ids: list[int]
    streams: list[RequestStream]
    parsers: Callable[[], ChoiceParser] | None
    """A fresh parser of one choice's text (tools, reasoning); None when the text is all content."""


async def start_chat(request: ChatCompletionRequest, raw_request: Request, ctx: ServingContext,
                     request_id: str, max_tokens_is_ceiling: bool = False) -> ChatTurn:
    """Plan the tools, apply the chat template and queue the request (one engine request per choice set).

    With `max_tokens_is_ceiling`, a max_tokens past what the context leaves after the prompt is lowered to
    that room instead of answering 400: Anthropic's max_tokens is only a ceiling, and Claude Code sends
    32000 whatever the model's context.
    """
    model = ctx.check_model(request.model)
    engine = ctx.engine
    config = ctx.config
    reasoning = config.reasoning_parser
    plan = None
    if request.tools or reasoning is not None:  # else prepare_tools has nothing to plan
        plan = await engine.run_blocking(prepare_tools, request, config.tool_call_parser,
                                         config.enable_auto_tool_choice, reasoning)
    params = request.to_sampling_params(ctx.engine.generation_defaults)
    template, template_kwargs = _request_template(request, config.trust_request_chat_template)
    prompt_ids = await engine.run_blocking(apply_chat_template, engine.tokenizer, request.messages,
                                           request.add_generation_prompt, plan, template, template_kwargs)
    room = engine.max_model_len - len(prompt_ids)
    if max_tokens_is_ceiling and params.max_tokens is not None and params.max_tokens > room > 0:
        params.max_tokens = room
    if params.max_tokens is None and 0 < room < params.min_tokens:
        # max_tokens resolves to what is left of the context; min_tokens must fit in it
        raise APIError(400, f"min_tokens ({params.min_tokens}) exceeds the {room} tokens this conversation "
                            f"leaves of max_model_len ({engine.max_model_len})", param="min_tokens")
    salt = ctx.cache_salt(raw_request, request.cache_salt)
    streams = await open_streams(ctx, request_id, [prompt_ids], params, salt, request.stream, request.priority,
                                 ctx.lora_request(model))
    parse = plan is not None and bool(plan.called) or reasoning is not None
    parsers = (lambda: ChoiceParser(plan, reasoning)) if parse else None
    return ChatTurn(request_id, model, prompt_ids, streams, parsers)


async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request,
                                 ctx: ServingContext) -> Response:
    """Serve one /v1/chat/completions request (validated body)."""
    turn = await start_chat(request, raw_request, ctx, new_id("chatcmpl"))
    request_id, model, streams, parsers = turn.request_id, turn.model, turn.streams, turn.parsers
    if request.stream:
        return SSEResponse(streams, lambda outputs: _chunks(ctx, request, outputs, request_id, model, parsers))

    (output,) = await final_outputs(raw_request, streams)
    return await ctx.engine.run_blocking(_response, ctx, request, output, request_id, model, parsers)


def _response(ctx: ServingContext, request: ChatCompletionRequest, output: RequestOutput, request_id: str,
              model: str, parsers) -> JSONResponse:
    choices = []
    for c in output.outputs:
        parser = parsers() if parsers is not None else None
        message = parser.message(c.text) if parser is not None else {"role": "assistant", "content": c.text}
        choices.append({
            "index": c.index,
            "message": message,
            "logprobs": _logprobs(ctx, request, c),
            "finish_reason": parser.finish_reason(c.finish_reason) if parser is not None else c.finish_reason,
            "stop_reason": c.stop_reason,
        })
    num_completion = sum(len(c.token_ids) for c in output.outputs)
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": now_s(), "model": model, "choices": choices,
        "usage": ctx.usage(len(output.prompt_token_ids), num_completion, output.num_cached_tokens),
    })


async def _chunks(ctx: ServingContext, request: ChatCompletionRequest, outputs: IndexedOutputs,
                  request_id: str, model: str, parsers) -> AsyncIterator[dict]:
    created = now_s()
    choice_parsers: dict[int, ChoiceParser] = {}

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **extra}

    # Every choice opens with the role, before any content.
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(request.n)])
    num_prompt_tokens = num_completion_tokens = num_cached = 0
    async for _, output in outputs:
        num_prompt_tokens = len(output.prompt_token_ids)
        num_cached = output.num_cached_tokens
        choices = []
        for c in output.outputs:
            num_completion_tokens += len(c.token_ids)
            if parsers is not None:  # one chunk per delta: a chunk carries one delta per choice
                if c.index not in choice_parsers:
                    choice_parsers[c.index] = parsers()
                parser = choice_parsers[c.index]
                for chunk_choice in _parsed_choices(ctx, request, c, parser):
                    yield chunk([chunk_choice])
                continue
            delta = {"content": c.text} if c.text or not c.finish_reason else {}
            choices.append({"index": c.index, "delta": delta, "logprobs": _logprobs(ctx, request, c),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        if choices:
            yield chunk(choices)
    if request.include_usage_in_stream:
        yield chunk([], usage=ctx.usage(num_prompt_tokens, num_completion_tokens, num_cached))


def _parsed_choices(ctx: ServingContext, request: ChatCompletionRequest, c: CompletionOutput,
                    parser: ChoiceParser) -> list[dict]:
    """The chunk choices of one output piece through its parser: each delta in turn, the logprobs with the
    first and the finish reason with the last (an empty delta carries them when the parser holds the text)."""
    deltas = parser.deltas(c.text, final=c.finish_reason is not None)
    logprobs = _logprobs(ctx, request, c)
    if not deltas and (c.finish_reason is not None or logprobs is not None):
        deltas = [{}]
    choices = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if choices:
        choices[0]["logprobs"] = logprobs
        choices[-1]["finish_reason"] = parser.finish_reason(c.finish_reason)
        choices[-1]["stop_reason"] = c.stop_reason
    return choices
