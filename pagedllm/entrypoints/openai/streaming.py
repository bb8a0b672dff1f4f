"""From engine streams to the client: queue a request's prompts, then either wait for the final outputs
or send each output as it comes as server-sent events. A client that goes away aborts its requests.

    open_streams ─┬─► final_outputs(raw_request, streams)         (one JSON answer)
                  └─► SSEResponse(streams, render)                 (data: {...} ... data: [DONE])
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_llm import RequestFailedError, RequestStream, RequestTimeoutError
from pagedllm.entrypoints.openai.context import ServingContext
from pagedllm.entrypoints.openai.errors import APIError, api_error_from
from pagedllm.outputs import RequestOutput

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
