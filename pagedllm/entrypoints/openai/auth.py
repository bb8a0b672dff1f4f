"""Who is calling: bearer-token auth on /v1/*, and the prefix-cache salt that isolates each key's tenant."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi import Request

from pagedllm.entrypoints.openai.errors import APIError


ANTHROPIC_PATH = "/v1/messages"
"""Anthropic's Messages API: its clients send the key as `x-api-key`, and expect errors in its shape."""


def find_api_key(request: Request, api_keys: Sequence[str]) -> str | None:
    """The configured key the bearer token (or, on Anthropic's routes, the x-api-key header) matches,
    compared in constant time; None if none does."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = request.headers.get("x-api-key", "") if request.url.path.startswith(ANTHROPIC_PATH) else ""
        if not token:
            return None
    token_bytes = token.strip().encode()
    matched = None
    for key in api_keys:  # check every key, so timing does not reveal which one matched
        if hmac.compare_digest(token_bytes, key.encode()):
            matched = key
    return matched


_KEYED_PATHS = ("/tokenize", "/detokenize")
"""Besides /v1/*: they run the tokenizer on whatever they are sent."""


def _needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in _KEYED_PATHS


class APIKeyMiddleware:
    """Bearer-token auth on /v1/*, /tokenize and /detokenize: a 401 unless the token matches a key (the key lands in scope state)."""

    def __init__(self, app, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and self.api_keys and _needs_key(path) and scope.get("method") != "OPTIONS":
            key = find_api_key(Request(scope), self.api_keys)
            if key is None:
                error = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                if path.startswith(ANTHROPIC_PATH):
                    error.message = "a valid API key is required: send 'x-api-key: <key>'"
                    error.anthropic = True
                response = error.response()
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


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


def request_api_key(raw_request: Request) -> str | None:
    """The key APIKeyMiddleware matched for this request (None when auth is off)."""
    return getattr(raw_request.state, "api_key", None)
