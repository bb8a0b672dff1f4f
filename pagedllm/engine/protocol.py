"""Messages between the front end and the engine core (in-process, or msgpack over ZMQ)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreRequest:
    """A tokenized, validated request, ready for the scheduler."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
