"""OpenAI-style error bodies, and the status each engine-side failure maps to.

A 5xx never carries exception text (it may hold paths or internals): the client gets the request
id, the log gets the details.
"""

from __future__ import annotations

import contextvars
import logging
import re

from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import EngineStoppingError, RequestFailedError, RequestTimeoutError
from pagedllm.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "overloaded",
    500: "internal_server_error", 503: "service_unavailable", 504: "timeout_error",
}

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                    504: "timeout_error"}
"""Anthropic's error types by status (anything else is its api_error)."""

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
"""The X-Request-Id of the request being served (set by RequestIdMiddleware)."""


class APIError(Exception):
    """An error to answer with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.anthropic = False
        """Answer in Anthropic's error shape (the Messages API's routes)."""

    def body(self) -> dict:
        if self.anthropic:
            return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error(exc: BaseException | str | None = None) -> APIError:
    """A 500 that names the request id only; the cause goes to the log."""
    request_id = current_request_id.get()
    if exc is not None:
        logger.error("request %s failed: %s", request_id, exc if isinstance(exc, str) else repr(exc))
    suffix = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"the request failed{suffix}; the server log has the details", code="internal_error")


def api_error_from(exc: BaseException) -> APIError:
    """Map an engine-side exception to the status the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        named = re.match(r"([a-z_]+) must", str(exc))  # SamplingParams names the field first
        return APIError(400, str(exc), param=named.group(1) if named else None)
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine is not available; it stopped", code="engine_dead")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), code="request_timeout")
    if isinstance(exc, EngineStoppingError):
        return APIError(503, str(exc), code="server_shutting_down")
    if isinstance(exc, RequestFailedError):
        return internal_error(exc)
    return internal_error(exc)
