"""What every endpoint shares: OpenAI-style errors, body parsing, auth, tenant salts, SSE."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedllm.engine.async_llm import AsyncLLM, RequestFailedError, RequestStream
from pagedllm.errors import EngineDeadError, InvalidRequestError
from pagedllm.outputs import Logprob, LogprobsDict, RequestOutput

ModelT = TypeVar("ModelT", bound=BaseModel)

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
    500: "internal_server_error", 503: "service_unavailable",
}
_DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """An error to answer with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error_from(exc: BaseException) -> APIError:
    """Map an engine-side exception to the status the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        named = re.match(r"([a-z_]+) must", str(exc))  # SamplingParams names the field first
        return APIError(400, str(exc), param=named.group(1) if named else None)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"the request failed: {exc}")
    return APIError(500, f"the request failed: {type(exc).__name__}: {exc}")


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The body as JSON; 413 past max_bytes, 400 for invalid UTF-8 or invalid JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body ({declared} bytes) exceeds the limit of {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def parse_model(model_cls: type[ModelT], data: Any) -> ModelT:
    """Validate a JSON object into `model_cls`; a 400 names the first offending field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
        raise APIError(400, f"{param}: {message}{more}" if param else message + more, param=param) from None


def find_api_key(request: Request, api_keys: Sequence[str]) -> str | None:
    """The configured key the bearer token matches, compared in constant time; None if none does."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    token_bytes = token.strip().encode()
    matched = None
    for key in api_keys:  # check every key, so timing does not reveal which one matched
        if hmac.compare_digest(token_bytes, key.encode()):
            matched = key
    return matched


def tenant_cache_salt(api_key: str | None, request_salt: str | None, share_across_keys: bool) -> str | None:
    """The prefix-cache salt of a request: its tenant's (from the API key) joined with its own.

    The tenant part is a fixed-length digest, so no request salt can imitate another tenant's.
    """
    tenant = None
    if api_key is not None and not share_across_keys:
        tenant = hashlib.sha256(b"pagedllm-tenant:" + api_key.encode()).hexdigest()
    if tenant is None:
        return request_salt
    return tenant if request_salt is None else f"{tenant}:{request_salt}"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse_event(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-event stream whose generator is always closed, so a disconnect aborts its request."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def cancel_on_disconnect(request: Request, awaitable: Awaitable) -> Any:
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


@dataclass
class ServingContext:
    """What the endpoint handlers share: the engine and the server's settings."""

    engine: AsyncLLM
    served_model_names: list[str]
    share_prefix_cache_across_keys: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, requested: str | None) -> str:
        """The model name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested in self.served_model_names:
            return requested or self.model_name
        raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                            f"{', '.join(map(repr, self.served_model_names))}", param="model", code="model_not_found")

    def cache_salt(self, raw_request: Request, request_salt: str | None) -> str | None:
        api_key = getattr(raw_request.state, "api_key", None)
        return tenant_cache_salt(api_key, request_salt, self.share_prefix_cache_across_keys)


def open_streams(engine: AsyncLLM, request_id: str, prompts: Sequence, params, salt: str | None,
                 stream: bool) -> list[RequestStream]:
    """Queue one engine request per prompt; all or nothing (a bad prompt aborts the others)."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(engine.add_request(f"{request_id}-{i}", prompt, params, salt, stream))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The last (cumulative) output of each stream; on any error every stream is closed."""

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


async def merged_outputs(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def top_entries(entry: LogprobsDict, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely candidates of one position, most likely first."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].logprob, reverse=True)[:k]


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def check_failed(output: RequestOutput) -> None:
    """A sequence that failed alone makes its request fail with a 500 naming the error."""
    for completion in output.outputs:
        if completion.error is not None:
            raise APIError(500, f"the request failed: {completion.error}")
