"""A request: what the front end sends the core, and the scheduler's state on top of it."""

from __future__ import annotations

import enum
import time
from collections.abc import Collection

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
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


class EngineCoreRequest(msgspec.Struct):
    """A tokenized, validated request as the front end hands it to the engine core.

    This is what crosses the process boundary (msgpack, inside AddRequestMsg); the core's
    `Request` extends it with progress. With n > 1 (or best_of) it stands for several
    sequences: see `SamplingParams.sequence_req_ids`.
    """

    req_id: str
    """The front end's request id."""
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: Collection[int]
    """Token ids that end generation (unless sampling_params.ignore_eos)."""
    max_tokens: int
    """The resolved output budget: sampling_params.max_tokens, or what max_model_len leaves."""
    arrival_time: float = msgspec.field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Extra prefix-cache key: requests with different salts share no cached blocks."""
    priority: int = 0
    """With the 'priority' scheduling policy: lower runs sooner (ties by arrival). Must be 0 under 'fcfs'."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter to generate with; None = the base model. Also a prefix-cache key."""
    pooling_params: PoolingParams | None = None
    """Set for a pooling (embedding) request: its prompt is computed, pooled and the request finishes,
    nothing sampled (max_tokens 0)."""


class Request(EngineCoreRequest, eq=False):
    """One sequence to generate: an EngineCoreRequest plus the scheduler's view of its progress.

    Progress is one counter, `num_computed_tokens`, against `num_tokens` (prompt + output).
    Whatever lies between them (a prompt, a chunk of it, the last sampled token, or a
    preempted request's whole history) is what the scheduler hands out next.

        all_token_ids:  [ prompt ........................ | output ....... ]
                        [ computed (KV in cache) | to compute   ]
                                                 ^ num_computed_tokens
    """

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    all_token_ids: list[int] = msgspec.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at the last admission."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = msgspec.field(default_factory=list)
    """Hash chain of this request's full blocks, extended as tokens arrive (prefix caching)."""
    stop_token_id_set: frozenset[int] = frozenset()
    """sampling_params.stop_token_ids as a set, built once per user request and shared by its sequences
    (each step checks the last token against it)."""
    queue_time: float | None = None
    """Seconds from arrival to the first admission (set once, by the scheduler)."""
    queue_time_sent: bool = False
    """True once an output carried queue_time to the front end (it is reported once per request)."""
    beam_group_id: str | None = None
    """The beam-search request this is a beam of (core/beam_selection.py); its beams are scheduled,
    preempted and resumed together."""

    @classmethod
    def for_sequences(cls, req: EngineCoreRequest) -> list[Request]:
        """One Request per sequence of `req`; with n > 1, sequence i samples with `for_sequence(i)`.

        What the sequences have in common (prompt, eos ids, stop set, the params' lists) is built
        once and shared, never copied per sequence: nothing mutates them.
        """
        seq_ids = req.sampling_params.sequence_req_ids(req.req_id)
        params = req.sampling_params
        prompt = list(req.prompt_token_ids)
        eos = frozenset(req.eos_token_ids)
        stop_set = frozenset(params.stop_token_ids)
        return [
            cls(seq_id, prompt, params if len(seq_ids) == 1 else params.for_sequence(index),
                eos, req.max_tokens, req.arrival_time, req.cache_salt, req.priority, req.lora_request,
                req.pooling_params, stop_token_id_set=stop_set)
            for index, seq_id in enumerate(seq_ids)
        ]

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if not self.stop_token_id_set and self.sampling_params.stop_token_ids:
            self.stop_token_id_set = frozenset(self.sampling_params.stop_token_ids)

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

    def append_output_tokens(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """Append sampled tokens up to the first that finishes the request; returns those appended."""
        for i, token_id in enumerate(token_ids):
            self.append_output_token(token_id)
            if self.check_stop(max_model_len):
                return token_ids[: i + 1]
        return list(token_ids)

    def check_stop(self, max_model_len: int) -> bool:
        """Finish the request if its last token ends it (EOS, a stop token, max_tokens or max_model_len).

        Sets `status` (and `stop_reason` for a stop token); True if it finished. EOS and stop tokens
        count only once min_tokens are out.
        """
        token_id = self.output_token_ids[-1]
        params = self.sampling_params
        if self.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in self.stop_token_id_set:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token_id
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def take_queue_time(self) -> float | None:
        """queue_time the first time it is asked for once known, None otherwise (the first output carries it)."""
        if self.queue_time is None or self.queue_time_sent:
            return None
        self.queue_time_sent = True
        return self.queue_time
