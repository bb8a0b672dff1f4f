"""Typed errors: a user's or a config's mistake, never an internal invariant."""


class PagedLLMError(Exception):
    """Base class of every error pagedllm raises on purpose."""


class InvalidRequestError(PagedLLMError, ValueError):
    """A request that can never be served as asked (maps to HTTP 400)."""


class ModelLoadError(PagedLLMError):
    """A model that cannot be loaded: missing path, unsupported architecture or format, corrupt file."""


class EngineDeadError(PagedLLMError, RuntimeError):
    """The engine core stopped; no further requests can be served (maps to HTTP 503)."""


class InvalidModelFileError(ModelLoadError, ValueError):
    """A model file (GGUF, safetensors, config, adapter, tokenizer) that is malformed or inconsistent: the message
    is one line naming the file, the key or tensor (``where``) and what is wrong with it."""

    def __init__(self, path, where: str, what: str) -> None:
        self.path, self.where, self.what = str(path), where, what
        super().__init__(f"invalid model file {self.path!r}: {where}: {what}")
