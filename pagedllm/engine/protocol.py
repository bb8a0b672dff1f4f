"""Messages between the front end and the engine core (in-process, or msgpack over ZMQ).

Across a socket only the typed messages below travel, encoded with msgspec's msgpack
(never pickle). Each direction has one tagged union, so a decoder rejects anything else:

    front end -> core:  AddRequestMsg | AbortRequestsMsg | UtilityRequestMsg | ShutdownMsg
    core -> front end:  ReadyMsg | OutputsMsg | RequestRejectedMsg | UtilityResultMsg | EngineDeadMsg

A request travels as `EngineCoreRequest` (defined in core/request.py, since the core's
`Request` extends it); it is re-exported here with the other messages.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.metrics.stats import EngineStatsMsg, KVMapMsg, KVMapRequest  # noqa: F401 (the core sends them)


# --- front end -> core ----------------------------------------------------------------


class AddRequestMsg(msgspec.Struct, tag="add"):
    """Queue one request (all of its sequences when n > 1)."""

    request: EngineCoreRequest


class AbortRequestsMsg(msgspec.Struct, tag="abort"):
    """End these core requests now and free their blocks (unknown ids are ignored)."""

    req_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


class UtilityRequestMsg(msgspec.Struct, tag="utility"):
    """Ask the core for something outside the step loop; answered by a UtilityResultMsg."""

    call_id: int
    method: str
    """One of UTILITY_METHODS."""


class ShutdownMsg(msgspec.Struct, tag="shutdown"):
    """Leave the busy loop and exit cleanly."""


UTILITY_METHODS = ("stats", "check_kv_leaks", "ping", "watch_kv_map", "unwatch_kv_map")
"""watch_kv_map: publish a KVMapMsg in the stats, at a bounded rate, for the next KV_MAP_LEASE_S seconds (the
dashboard renews it while someone watches); unwatch_kv_map: stop now (the last viewer left; the lease only
covers a front end that died). Nobody watching costs nothing."""

FrontendMessage = Union[AddRequestMsg, AbortRequestsMsg, UtilityRequestMsg, ShutdownMsg]


# --- core -> front end ----------------------------------------------------------------


class ReadyMsg(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded: what the front end needs to tokenize and validate."""

    model_path: str
    """The Hugging Face directory actually loaded (tokenizer files live there)."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int


class OutputsMsg(msgspec.Struct, tag="outputs"):
    """What one step produced, with the core's stats after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineStatsMsg | None = None
    timestamp: float = 0.0
    """time.monotonic() in the core when the step ended."""


class RequestRejectedMsg(msgspec.Struct, tag="rejected"):
    """add_request failed for this core request; nothing was queued."""

    req_id: str
    message: str
    invalid_request: bool = True
    """True: the request itself is at fault (HTTP 400); False: an internal error (HTTP 500)."""


class UtilityResultMsg(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineDeadMsg(msgspec.Struct, tag="dead"):
    """The core hit a fatal error and is exiting; `error` says what happened."""

    error: str


CoreMessage = Union[ReadyMsg, OutputsMsg, RequestRejectedMsg, UtilityResultMsg, EngineDeadMsg]
