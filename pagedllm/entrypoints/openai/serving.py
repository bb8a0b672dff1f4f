"""What every endpoint handler shares: the engine and the server's settings (`ServingContext`), the
fields every response carries (ids, timestamps, usage), and the way from engine streams to the client:
queue a request's prompts, then either wait for the final outputs or send each output as it comes as
server-sent events. A client that goes away aborts its requests.

    open_streams ─┬─► final_outputs(raw_request, streams)         (one JSON answer)
                  └─► SSEResponse(streams, render)                 (data: {...} ... data: [DONE])
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_llm import AsyncLLM, RequestFailedError, RequestStream, RequestTimeoutError
from pagedllm.entrypoints.openai.auth import request_api_key, tenant_cache_salt
from pagedllm.entrypoints.openai.cli_args import ServerConfig
from pagedllm.entrypoints.openai.errors import APIError, api_error_from
from pagedllm.entrypoints.openai.serving_lora import LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import ServerMetrics
from pagedllm.outputs import RequestOutput


@dataclass
class ServingContext:
    """The engine and the server's settings, as every handler sees them."""

    engine: AsyncLLM
    served_model_names: list[str]
    config: ServerConfig
    metrics: ServerMetrics | None = None
    loras: LoRARegistry | None = None
    """The LoRA adapters a request's model may name (serving_lora.py); None when LoRA is off."""

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def report_cached_tokens(self) -> bool:
        """Whether usage may say how many prompt tokens were cached: only when no tenant can learn
        from it what another sent (keys that do not share the cache), or when the operator opts in."""
        c = self.config
        return c.enable_prompt_tokens_details or (bool(c.api_keys) and not c.share_prefix_cache_across_keys)

    def check_model(self, requested: str | None) -> str:
        """The model name to answer with (the first served name for any of them, as vLLM); 404 for a model this
        server does not serve."""
        if requested is None or requested in self.served_model_names:
            return self.model_name
        if self.loras is not None and requested in self.loras.adapters:
            return requested
        served = [*self.served_model_names, *(self.loras.adapters if self.loras is not None else ())]
        raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                            f"{', '.join(map(repr, served))}", param="model", code="model_not_found")

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a (checked) model name stands for; None for the base model."""
        return self.loras.adapters.get(model) if self.loras is not None else None

    def cache_salt(self, raw_request: Request, request_salt: str | None) -> str | None:
        """The prefix-cache salt: the request's own, joined with its tenant's when the server has keys."""
        if not self.config.api_keys:
            return request_salt
        return tenant_cache_salt(request_api_key(raw_request), request_salt, self.config.share_prefix_cache_across_keys)

    def usage(self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
        usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                 "total_tokens": num_prompt_tokens + num_completion_tokens}
        if self.report_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
        return usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


_DISCONNECT_POLL_S = 0.5

IndexedOutputs = AsyncIterator[tuple[int, RequestOutput]]
"""(prompt index, cumulative-or-delta output) pairs as they arrive from a request's streams."""


async def open_streams(ctx: ServingContext, request_id: str, prompts: Sequence, params, salt: str | None,
                       stream: bool, priority: int = 0, lora_request=None) -> list[RequestStream]:
    """Queue one engine request per prompt; all or nothing (a bad prompt aborts the others); APIError on failure.

    Past the bound on waiting requests the answer is 429 (nothing queued); past the request
    timeout every stream raises RequestTimeoutError and its request is aborted in the core.
    """
    engine = ctx.engine
    bound = ctx.config.max_num_waiting
    if bound and engine.num_waiting_requests + len(prompts) > bound:
        if ctx.metrics is not None:
            ctx.metrics.record_rejected("overloaded")
        raise APIError(429, f"the server is overloaded: {engine.num_waiting_requests} requests are waiting "
                            f"(the limit is {bound}); retry later", code="overloaded",
                       headers={"Retry-After": str(ctx.config.retry_after_s)})
    streams: list[RequestStream] = []
    timeout_s = ctx.config.request_timeout
    loop = asyncio.get_running_loop()
    started = loop.time()
    if timeout_s:
        loop.call_later(timeout_s, _expire, streams, timeout_s, ctx)
    try:
        for i, prompt in enumerate(prompts):  # prompts x max(n, best_of) is bounded per request, not per prompt
            streams.append(await engine.add_request(f"{request_id}-{i}", prompt, params, salt, stream, priority,
                                                    lora_request, num_prompts=len(prompts)))
    except BaseException as e:
        for s in streams:
            s.close()
        if isinstance(e, Exception):
            raise api_error_from(e) from None
        raise
    if timeout_s and loop.time() - started >= timeout_s:  # the deadline passed while the last was tokenized
        _expire(streams, timeout_s, ctx)
    return streams


def _expire(streams: list[RequestStream], timeout_s: float, ctx: ServingContext) -> None:
    """The deadline passed: abort what is still open (freeing its blocks); its consumer learns why."""
    expired = False
    for s in streams:
        expired |= s.fail(RequestTimeoutError(f"the request did not finish within the server's request timeout "
                                              f"of {timeout_s:g} s and was aborted"))
    if expired and ctx.metrics is not None:
        ctx.metrics.record_rejected("timeout")


async def final_outputs(raw_request: Request, streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The last (cumulative) output of each stream; a disconnect or any error closes them all (APIError)."""
    try:
        return await _cancel_on_disconnect(raw_request, _last_outputs(streams))
    except Exception as e:
        raise api_error_from(e) from None


class SSEResponse(StreamingResponse):
    """Server-sent events of `render(outputs)`, then `data: [DONE]`; an error mid-stream becomes an error
    event. The generator is always closed, so a disconnect aborts the request's streams.

    `frame` writes one event (named events for the Responses and Messages APIs); `done` is the closing
    `data: [DONE]` of chat and completions streams, which those APIs do not send."""

    def __init__(self, streams: Sequence[RequestStream], render: Callable[[IndexedOutputs], AsyncIterator[dict]],
                 frame: Callable[[dict | str], str] | None = None, done: bool = True) -> None:
        super().__init__(_sse_frames(streams, render, frame or sse_event, done), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def named_sse_event(data: dict) -> str:
    """An event with its `type` as the SSE event name, as the Responses and Messages APIs send them."""
    return f"event: {data.get('type', 'error')}\n" + sse_event(data)


def sse_event(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def _sse_frames(streams: Sequence[RequestStream], render: Callable[[IndexedOutputs], AsyncIterator[dict]],
                      frame: Callable[[dict | str], str], done: bool) -> AsyncIterator[str]:
    outputs = _merged_outputs(streams)
    events = render(outputs)
    try:
        async for event in events:
            yield frame(event)
    except Exception as e:
        yield frame(api_error_from(e).body())
    finally:
        await events.aclose()
        await outputs.aclose()
    if done:
        yield frame("[DONE]")


async def _cancel_on_disconnect(request: Request, awaitable: Awaitable) -> Any:
    """Await `awaitable`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def _last_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The last output of each stream; on any error every stream is closed."""

    async def last_of(s: RequestStream) -> RequestOutput:
        last = None
        async for output in s:
            last = output
        if last is None:
            raise RequestFailedError(f"request {s.request_id} ended without output")
        return last

    tasks = [asyncio.ensure_future(last_of(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()


async def _merged_outputs(streams: Sequence[RequestStream]) -> IndexedOutputs:
    """(stream index, output) pairs as they arrive from several streams; closing this closes them all."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, s: RequestStream) -> None:
        try:
            async for output in s:
                queue.put_nowait((index, output))
            queue.put_nowait((index, done))
        except BaseException as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()
