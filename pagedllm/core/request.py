"""A request's state as the scheduler sees it: tokens, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Every finished state sorts after every live one: `status > PREEMPTED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason: 'stop', 'length' or 'abort'; None while live."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence to generate.

    Progress is one counter, `num_computed_tokens`, against `num_tokens` (prompt + output).
    Whatever lies between them (a prompt, a chunk of it, the last sampled token, or a
    preempted request's whole history) is what the scheduler hands out next.

        all_token_ids:  [ prompt ........................ | output ....... ]
                        [ computed (KV in cache) | to compute   ]
                                                 ^ num_computed_tokens
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    """The resolved output budget: sampling_params.max_tokens, or what max_model_len leaves."""
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Extra prefix-cache key: requests with different salts share no cached blocks."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at the last admission."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    """Hash chain of this request's full blocks, extended as tokens arrive (prefix caching)."""
    pending_forks: list[Request] = field(default_factory=list)
    """Parallel samples (n > 1) not yet forked: they sample their first token from this
    request's prompt logits, then take its block table (shared, copy-on-write)."""
    fork_parent: Request | None = None
    """Set while this request waits to be forked from `fork_parent`."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
