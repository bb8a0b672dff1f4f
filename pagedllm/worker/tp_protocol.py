"""Messages between the engine core and its tensor-parallel workers (msgspec msgpack over ZMQ).

The engine binds one ROUTER socket; each worker connects one DEALER, so a "broadcast" is the same
encoded bytes sent to every rank. Typed messages only, never pickle:

    worker -> engine:  HelloMsg, ReadyMsg, StepDoneMsg, WorkerErrorMsg
    engine -> worker:  InitWorkerMsg, ExecuteStepMsg, StopWorkerMsg

    worker                                  engine
      | -- TCPStore get "engine_address" -->  |   (the rendezvous store is hosted by the engine)
      | -- HelloMsg(rank) ------------------> |
      | <------------------ InitWorkerMsg --- |   model, dtype, KV blocks, timeouts
      |   init_process_group, load shard, KV  |
      | -- ReadyMsg ------------------------> |
      | <------------------ ExecuteStepMsg -- |   every step, to every rank
      | -- StepDoneMsg ---------------------> |   rank 0 carries the ModelRunnerOutput
"""

from __future__ import annotations

from typing import Union

import msgspec

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput

ENGINE_ADDRESS_KEY = "pagedllm/engine_address"
HEARTBEAT_KEY = "pagedllm/heartbeat/{rank}"
STORE_PREFIX_TP = "pagedllm/tp"


class HelloMsg(msgspec.Struct, tag="hello"):
    rank: int
    pid: int
    hostname: str


class InitWorkerMsg(msgspec.Struct, tag="init"):
    model_dir: str
    """The Hugging Face directory (the same path must exist on every host)."""
    dtype: str
    num_blocks: int
    num_host_blocks: int
    block_size: int
    seed: int
    timeout_s: float
    """Collective timeout: a peer silent for this long makes the waiting ranks fail."""


class ReadyMsg(msgspec.Struct, tag="ready"):
    rank: int
    num_kv_heads: int
    """KV heads in this rank's cache (checked against the engine's sizing)."""


class ExecuteStepMsg(msgspec.Struct, tag="step"):
    step_id: int
    sched: SchedulerOutput


class StopWorkerMsg(msgspec.Struct, tag="stop"):
    pass


class StepDoneMsg(msgspec.Struct, tag="done"):
    rank: int
    step_id: int
    output: ModelRunnerOutput | None = None
    """Rank 0's full output; None from the others."""
    sampled_token_ids: dict[str, list[int]] | None = None
    """The other ranks' sampled tokens, to check that every rank sampled the same."""


class WorkerErrorMsg(msgspec.Struct, tag="error"):
    rank: int
    message: str


ToWorker = Union[InitWorkerMsg, ExecuteStepMsg, StopWorkerMsg]
FromWorker = Union[HelloMsg, ReadyMsg, StepDoneMsg, WorkerErrorMsg]

encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
