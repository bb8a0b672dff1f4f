"""OpenAI-style error bodies, and the status each engine-side failure maps to."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import RequestFailedError
from pagedllm.errors import EngineDeadError, InvalidRequestError
from pagedllm.outputs import RequestOutput

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
    500: "internal_server_error", 503: "service_unavailable",
}


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


def check_failed(output: RequestOutput) -> None:
    """A sequence that failed alone makes its request fail with a 500 naming the error."""
    for completion in output.outputs:
        if completion.error is not None:
            raise APIError(500, f"the request failed: {completion.error}")
