"""POST /v1/chat/completions: messages through the model's chat template, answers or SSE deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.context import ServingContext, new_id, now_s
from pagedllm.entrypoints.openai.errors import APIError, check_failed
from pagedllm.entrypoints.openai.chat_message import ChatMessage
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.streaming import IndexedOutputs, SSEResponse, final_outputs, open_streams
from pagedllm.outputs import CompletionOutput, Logprob, LogprobsDict, RequestOutput


def apply_chat_template(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template; 400 if it cannot be applied."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:  # template errors (e.g. a role it refuses) are the request's fault
        raise APIError(400, f"the chat template cannot be applied to these messages: {e}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


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


async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request,
                                 ctx: ServingContext) -> Response:
    """Serve one /v1/chat/completions request (validated body)."""
    model = ctx.check_model(request.model)
    params = request.to_sampling_params()
    engine = ctx.engine
    prompt_ids = await engine.run_blocking(apply_chat_template, engine.tokenizer, request.messages,
                                           request.add_generation_prompt)
    room = engine.max_model_len - len(prompt_ids)
    if params.max_tokens is None and 0 < room < params.min_tokens:
        # max_tokens resolves to what is left of the context; min_tokens must fit in it
        raise APIError(400, f"min_tokens ({params.min_tokens}) exceeds the {room} tokens this conversation "
                            f"leaves of max_model_len ({engine.max_model_len})", param="min_tokens")
    request_id = new_id("chatcmpl")
    salt = ctx.cache_salt(raw_request, request.cache_salt)
    streams = await open_streams(ctx, request_id, [prompt_ids], params, salt, request.stream, request.priority,
                                 ctx.lora_request(model))
    if request.stream:
        return SSEResponse(streams, lambda outputs: _chunks(ctx, request, outputs, request_id, model))

    (output,) = await final_outputs(raw_request, streams)
    return await engine.run_blocking(_response, ctx, request, output, request_id, model)


def _response(ctx: ServingContext, request: ChatCompletionRequest, output: RequestOutput, request_id: str,
              model: str) -> JSONResponse:
    check_failed(output)
    choices = [{
        "index": c.index,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": _logprobs(ctx, request, c),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    } for c in output.outputs]
    num_completion = sum(len(c.token_ids) for c in output.outputs)
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": now_s(), "model": model, "choices": choices,
        "usage": ctx.usage(len(output.prompt_token_ids), num_completion, output.num_cached_tokens),
    })


async def _chunks(ctx: ServingContext, request: ChatCompletionRequest, outputs: IndexedOutputs,
                  request_id: str, model: str) -> AsyncIterator[dict]:
    created = now_s()

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **extra}

    # Every choice opens with the role, before any content.
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(request.n)])
    num_prompt_tokens = num_completion_tokens = num_cached = 0
    async for _, output in outputs:
        check_failed(output)
        num_prompt_tokens = len(output.prompt_token_ids)
        num_cached = output.num_cached_tokens
        choices = []
        for c in output.outputs:
            num_completion_tokens += len(c.token_ids)
            delta = {"content": c.text} if c.text or not c.finish_reason else {}
            choices.append({"index": c.index, "delta": delta, "logprobs": _logprobs(ctx, request, c),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        if choices:
            yield chunk(choices)
    if request.include_usage_in_stream:
        yield chunk([], usage=ctx.usage(num_prompt_tokens, num_completion_tokens, num_cached))
