"""What one request may ask for, declared once: the ceilings no setting raises, and `RequestLimits`, the
limits a deployment sets below them (its fields become flags through `pagedllm.config`). `SamplingParams`,
the engine's front end and the OpenAI protocol read them here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MAX_STOP_STRINGS = 64
"""The most stop strings any request may carry (RequestLimits.max_stop_strings may only lower it)."""
MAX_LOGPROBS = 20
"""The most top logprobs a request may ask for, per token (beam search is bound by it too)."""
MAX_N = 64
"""Most sequences one API request may ask for (n and best_of)."""
MAX_PROMPTS = 64
"""Most prompts in one /v1/completions request."""

CEILINGS = {"max_stop_strings": MAX_STOP_STRINGS, "max_logprobs": MAX_LOGPROBS}
"""The RequestLimits fields a ceiling above bounds."""


@dataclass(frozen=True)
class RequestLimits:
    """How much one request may ask for; the front end refuses more with an InvalidRequestError naming
    the limit (HTTP 400). They bound what one request can cost its neighbours per step."""

    max_stop_token_ids: int = 256
    """Most stop_token_ids one request may carry."""
    max_logit_bias: int = 300
    """Most logit_bias entries one request may carry (OpenAI's limit)."""
    max_stop_strings: int = 16
    """Most stop strings one request may carry (at most 64)."""
    max_stop_string_chars: int = 1024
    """Longest stop string, in characters."""
    max_logprobs: int = MAX_LOGPROBS
    """Most top logprobs per generated or prompt token a request may ask for (at most 20)."""
    max_sequences_per_request: int = 256
    """Most sequences one request may generate: prompts x max(n, best_of)."""
    max_prompt_logprobs_positions: int = 2048
    """Longest prompt whose prompt_logprobs may be asked for (one entry per position)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{f.name} must be an integer >= 0, got {value!r}")
        if self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}")
        for name, ceiling in CEILINGS.items():
            if getattr(self, name) > ceiling:
                raise ValueError(f"{name} must be <= {ceiling}, got {getattr(self, name)}")
