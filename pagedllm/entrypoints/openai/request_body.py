"""Reading a request body: size limit, UTF-8, JSON, then validation into a protocol model."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.errors import APIError

ModelT = TypeVar("ModelT", bound=BaseModel)


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
