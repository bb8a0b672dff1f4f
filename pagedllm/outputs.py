"""What users get back: RequestOutput with one CompletionOutput per returned sequence."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One candidate token at one position, as vLLM users know it."""

    logprob: float
    rank: int | None = None
    """1 = the model's most likely token."""
    decoded_token: str | None = None


LogprobsDict = dict[int, Logprob]
"""token id -> Logprob, for one position."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None
    """'stop', 'length' or 'abort'; None while generating."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sequence, if any."""
    error: str | None = None
    """Why the sequence was aborted, when it failed alone."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class PoolingRequestOutput:
    """A pooling (embedding) request's result: one vector for its whole input."""

    request_id: str
    prompt_token_ids: list[int]
    """The tokens pooled (after the model's prompt prefix and any truncation)."""
    data: list[float] | None
    """The vector; None if the request failed (see `error`) or was aborted."""
    finished: bool = True
    error: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (last-token pooling only)."""

    @property
    def embedding(self) -> list[float] | None:
        return self.data
