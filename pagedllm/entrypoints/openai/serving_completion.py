"""POST /v1/completions: prompts (text or token ids) in, text_completion objects or SSE chunks out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.serving import (
    IndexedOutputs,
    ServingContext,
    SSEResponse,
    final_outputs,
    new_id,
    now_s,
    open_streams,
)
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.outputs import CompletionOutput, LogprobsDict, RequestOutput


def completion_logprobs(engine, token_ids: list[int], entries: list[LogprobsDict | None],
                        text_offset: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.

    `entries[i]` holds the chosen token and the top candidates of position i (None for a
    position without logprobs, such as the first prompt token).
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id) if entry else None
        token = chosen.decoded_token if chosen and chosen.decoded_token is not None else \
            (engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else "")
        tokens.append(token)
        token_logprobs.append(chosen.logprob if chosen else None)
        if entry is None:
            top_logprobs.append(None)
        else:
            ordered = sorted(entry.items(), key=lambda item: item[1].logprob, reverse=True)
            top_logprobs.append({(lp.decoded_token or ""): lp.logprob for _, lp in ordered})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _prompt_text(engine, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return engine.tokenizer.decode(output.prompt_token_ids) if engine.tokenizer is not None else ""


def _choice(engine, request: CompletionRequest, output: RequestOutput, completion: CompletionOutput,
            index: int, echo_prompt: bool) -> dict:
    text = completion.text
    logprobs = None
    prefix = _prompt_text(engine, output) if echo_prompt else ""
    if request.logprobs is not None:
        token_ids, entries = list(completion.token_ids), list(completion.logprobs or [])
        if echo_prompt:
            prompt_entries = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids))
            token_ids = list(output.prompt_token_ids) + token_ids
            entries = prompt_entries + entries
        logprobs = completion_logprobs(engine, token_ids, entries, 0)
    return {"index": index, "text": prefix + text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


async def create_completion(request: CompletionRequest, raw_request: Request, ctx: ServingContext) -> Response:
    """Serve one /v1/completions request (validated body)."""
    model = ctx.check_model(request.model)
    params = request.to_sampling_params(ctx.engine.generation_defaults)
    engine = ctx.engine
    request_id = new_id("cmpl")
    salt = ctx.cache_salt(raw_request, request.cache_salt)
    streams = await open_streams(ctx, request_id, request.prompts(), params, salt, request.stream, request.priority,
                                 ctx.lora_request(model))
    if request.stream:
        return SSEResponse(streams, lambda outputs: _chunks(ctx, request, outputs, request_id, model))

    outputs = await final_outputs(raw_request, streams)
    # Echoed prompts and logprobs of long outputs take a while to decode and encode: off the loop.
    return await engine.run_blocking(_response, ctx, request, params.n, outputs, request_id, model)


def _response(ctx: ServingContext, request: CompletionRequest, n: int, outputs: list[RequestOutput],
              request_id: str, model: str) -> JSONResponse:
    engine = ctx.engine
    choices, num_prompt, num_completion, num_cached = [], 0, 0, 0
    for prompt_index, output in enumerate(outputs):
        num_prompt += len(output.prompt_token_ids)
        num_cached += output.num_cached_tokens
        for completion in output.outputs:
            num_completion += len(completion.token_ids)
            choices.append(_choice(engine, request, output, completion,
                                   prompt_index * n + completion.index, request.echo))
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": now_s(), "model": model,
        "choices": choices, "usage": ctx.usage(num_prompt, num_completion, num_cached),
    })


async def _chunks(ctx: ServingContext, request: CompletionRequest, outputs: IndexedOutputs, request_id: str,
                  model: str) -> AsyncIterator[dict]:
    engine = ctx.engine
    created = now_s()
    n = request.n
    num_prompt_tokens: dict[int, int] = {}
    num_completion_tokens = 0
    num_cached = 0
    echoed: set[int] = set()
    text_offsets: dict[int, int] = {}
    async for prompt_index, output in outputs:
        if prompt_index not in num_prompt_tokens:
            num_prompt_tokens[prompt_index] = len(output.prompt_token_ids)
            num_cached += output.num_cached_tokens
        choices = []
        for completion in output.outputs:
            index = prompt_index * n + completion.index
            echo = request.echo and index not in echoed
            echoed.add(index)
            num_completion_tokens += len(completion.token_ids)
            choice = _choice(engine, request, output, completion, index, echo)
            if choice["logprobs"] is not None:
                offset = text_offsets.get(index, 0)
                choice["logprobs"]["text_offset"] = [o + offset for o in choice["logprobs"]["text_offset"]]
                text_offsets[index] = offset + len(choice["text"])
            choices.append(choice)
        if choices:
            yield {"id": request_id, "object": "text_completion", "created": created, "model": model,
                   "choices": choices}
    if request.include_usage_in_stream:
        yield {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": ctx.usage(sum(num_prompt_tokens.values()), num_completion_tokens, num_cached)}
