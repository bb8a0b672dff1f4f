"""Every HTTP request's way in, before its handler runs: the connection's header timeout (uvicorn's h11
protocol), the request id, the drain gate, then the body: content type, size and time limits, UTF-8, strict
JSON, and validation into a protocol model.

Strict JSON here means what no engine can use is a 400 up front: NaN/Infinity (and numbers that
overflow to infinity), integers beyond 64 bits, and lone UTF-16 surrogates (valid JSON, but no
tokenizer can encode them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import APIError, current_request_id, internal_error

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.lifecycle import Lifecycle

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_INNER_FIELD = re.compile(r"([a-z_][a-z0-9_.]*): ")
"""How a model validator's error names a field of the model it checks (see parse_model)."""
_PARSE_ON_LOOP_BYTES = 64 * 1024
"""Smaller bodies are parsed on the event loop (a thread hop costs more than the parse)."""


class RequestIdMiddleware:
    """Take the client's X-Request-Id (if sane) or make one; echo it on the response and expose it
    to handlers (errors.current_request_id), so a 500 can name it. An unhandled exception becomes
    that 500 here (inside, where the id is still known), its text going to the log only."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        token = current_request_id.set(request_id)

        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s failed", request_id)
            if started:  # too late for a status; the connection is cut
                raise
            await internal_error().response()(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


class DrainMiddleware:
    """Counts the requests in flight in `lifecycle`; once draining, answers new ones (and /health) 503."""

    def __init__(self, app, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining and scope.get("path") != "/metrics":
            response = APIError(503, "the server is shutting down", code="server_shutting_down",
                                headers={"Connection": "close"}).response()
            await response(scope, receive, send)
            return
        self.lifecycle.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.num_in_flight -= 1


def h11_protocol_with_header_timeout(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a complete request head within
    `timeout_s` of connecting or of finishing its previous response (uvicorn waits forever)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._busy():
                self._arm_header_timer()  # a request head is (partly) pending
            else:
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self._busy():
                self.transport.close()

        def _busy(self) -> bool:
            """A request head has arrived and its response is not complete."""
            return self.cycle is not None and not self.cycle.response_complete

    return HeaderTimeoutH11Protocol


def check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON: a cross-site form or text/plain post must not be obeyed."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = f"'{content_type}'" if content_type else "none"
        raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' "
                            f"(got {shown})", code="unsupported_media_type")


async def read_model(request: Request, model_cls: type[ModelT], max_bytes: int, read_timeout_s: float | None = None,
                     run_blocking: Callable[..., Awaitable[Any]] | None = None) -> ModelT:
    """The body validated into `model_cls` (see read_json_body); a big body is parsed and validated
    by `run_blocking` (a worker thread), so the event loop stays free."""
    body = await read_body_bytes(request, max_bytes, read_timeout_s)
    if run_blocking is not None and len(body) > _PARSE_ON_LOOP_BYTES:
        return await run_blocking(lambda: parse_model(model_cls, parse_json_body(body)))
    return parse_model(model_cls, parse_json_body(body))


async def read_json_body(request: Request, max_bytes: int, read_timeout_s: float | None = None) -> Any:
    """The body as JSON; 415 unless declared JSON, 413 past max_bytes, 408 when the client stalls
    more than read_timeout_s between chunks, 400 for invalid UTF-8 or JSON (see the module doc)."""
    return parse_json_body(await read_body_bytes(request, max_bytes, read_timeout_s))


async def read_body_bytes(request: Request, max_bytes: int, read_timeout_s: float | None = None) -> bytes:
    """The raw body, after the content-type, size and stall checks of read_json_body."""
    check_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body ({declared} bytes) exceeds the limit of {max_bytes} bytes")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), read_timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stalled: nothing received for {read_timeout_s:g} s",
                           code="request_timeout") from None
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class _HugeInteger:
    """An integer literal too long to be any field's value, kept unconverted: Python refuses to convert more than
    4300 digits (a ValueError, once a 500), and converting fewer costs time quadratic in their number."""

    __slots__ = ("num_digits",)

    def __init__(self, num_digits: int) -> None:
        self.num_digits = num_digits


def _parse_int(text: str) -> int | _HugeInteger:
    return int(text) if len(text) <= _MAX_INT_CHARS else _HugeInteger(len(text.lstrip("-")))


_MAX_INT_CHARS = 20  # "-9223372036854775808": longer literals are out of the 64-bit range anyway


def _reject_constant(name: str) -> Any:
    raise APIError(400, f"the request body is not valid JSON: {name} is not a number JSON allows")


def parse_json_body(body: bytes) -> Any:
    """Decode and parse a body strictly (see the module doc); APIError(400) naming the problem."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    _check_values(data, "", check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    return data


def _check_values(value: Any, path: str, check_strings: bool) -> None:
    """400 for a number no field can hold or a string no tokenizer can encode, naming where it is."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if check_strings:
                    _check_string(key, f"{where}.{key!r}" if where else repr(key))
                stack.append((child, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list):
            if item and all(type(x) is int for x in item):  # the common long list: token ids
                if max(item) > _INT64_MAX or min(item) < _INT64_MIN:
                    raise APIError(400, f"{where or 'the body'}: an integer is out of the 64-bit range",
                                   param=where or None)
                continue
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
        elif isinstance(item, _HugeInteger):
            raise APIError(400, f"{where or 'the body'}: the integer ({item.num_digits} digits) is out of the 64-bit "
                                "range", param=where or None)
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            if not _INT64_MIN <= item <= _INT64_MAX:
                raise APIError(400, f"{where or 'the body'}: the integer is out of the 64-bit range",
                               param=where or None)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise APIError(400, f"{where or 'the body'}: the number is too large (not finite)",
                               param=where or None)
        elif isinstance(item, str) and check_strings:
            _check_string(item, where)


def _check_string(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{where or 'the body'}: the text contains a lone UTF-16 surrogate "
                            f"(\\u{ord(text[e.start]):04x}) at character {e.start}, which is not valid Unicode",
                       param=where or None) from None


def parse_model(model_cls: type[ModelT], data: Any) -> ModelT:
    """Validate a JSON object into `model_cls`; a 400 names the first offending field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        loc, message, num_problems = _first_problem(e.errors())
        param = ".".join(loc) or None
        more = f" (and {num_problems - 1} more problems)" if num_problems > 1 else ""
        raise APIError(400, f"{param}: {message}{more}" if param else message + more, param=param) from None


def _first_problem(errors: list[dict]) -> tuple[list[str], str, int]:
    """(location, message, number of fields with problems) of a validation failure.

    A field of several types (`str | list[ContentPart]`) fails once per type, each error located
    under the type's name (`content.str`, `content.list[ContentPart].0.type`): the one that got
    deepest into the value is the one the client meant; when none got past the type, the message
    lists the types. Type names are left out of the location."""
    def field_of(error: dict) -> tuple:
        tag = next((i for i, part in enumerate(error["loc"]) if _is_type_tag(part)), len(error["loc"]))
        return error["loc"][:tag]

    first_field = field_of(errors[0])
    alternatives = [error for error in errors if field_of(error) == first_field]
    chosen = max(alternatives, key=lambda error: len(error["loc"]))
    loc = [str(part) for part in chosen["loc"] if not _is_type_tag(part)]
    message = chosen["msg"].removeprefix("Value error, ")
    if len(alternatives) > 1 and len(chosen["loc"]) == len(first_field) + 1:  # no type got past the top
        message = "Input should be " + " or ".join(str(error["loc"][-1]) for error in alternatives)
    inner = _INNER_FIELD.match(message) if chosen["type"] == "value_error" else None
    if inner:  # a model's own rule names the field inside it ("content: ..." at messages.2)
        loc.append(inner.group(1))
        message = message[inner.end():]
    return loc, message, len({field_of(error) for error in errors})


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)
