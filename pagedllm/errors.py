"""Typed errors: a user's or a config's mistake, never an internal invariant."""


class PagedLLMError(Exception):
    """Base class of every error pagedllm raises on purpose."""


class InvalidRequestError(PagedLLMError, ValueError):
    """A request that can never be served as asked (maps to HTTP 400)."""


class ModelLoadError(PagedLLMError):
    """A model that cannot be loaded: missing path, unsupported architecture or format, corrupt file."""


class EngineDeadError(PagedLLMError, RuntimeError):
    """The engine core stopped; no further requests can be served (maps to HTTP 503)."""
