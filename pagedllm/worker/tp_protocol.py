"""Messages between the engine core and its tensor-parallel workers (msgspec msgpack over ZMQ).

The engine binds one ROUTER socket; each worker connects one DEALER, so a "broadcast" is the same
encoded bytes sent to every rank. Typed messages only, never pickle:

    worker -> engine:  HelloMsg, AuthMsg, ReadyMsg, StepDoneMsg, WorkerErrorMsg
    engine -> worker:  ChallengeMsg, RefusedMsg, InitWorkerMsg, ExecuteStepMsg, StopWorkerMsg

    worker                                  engine
      | -- TCPStore get "engine_address" -->  |   (the rendezvous store is hosted by the engine)
      | -- HelloMsg(rank, nonce_w) ---------> |
      | <------ ChallengeMsg(nonce_e, proof) --|   proof = HMAC(secret, "engine" nonce_w nonce_e)
      | -- AuthMsg(rank, proof) ------------> |   proof = HMAC(secret, "worker" rank nonce_w nonce_e)
      | <---------- RefusedMsg (wrong secret) |   ... or, once every rank has proved it:
      | <------------------ InitWorkerMsg --- |   model, dtype, KV blocks, timeouts
      |   init_process_group, load shard, KV  |
      | -- ReadyMsg ------------------------> |
      | <------------------ ExecuteStepMsg -- |   every step, to every rank (kv_load: each rank its shard)
      | -- StepDoneMsg ---------------------> |   rank 0 carries the ModelRunnerOutput, each its kv_spilled

The shared secret authenticates both ends before any work is exchanged: a worker must know it to
join, and an engine must know it before a worker loads what it is told to. Each worker connects
with a random socket identity that the engine accepts only once the worker has proved the secret;
messages from any other peer are dropped. The secret is never sent, and nothing is encrypted: run
the control plane (and gloo) on a network you trust.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Union

import msgspec

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput

ENGINE_ADDRESS_KEY = "pagedllm/engine_address"
HEARTBEAT_KEY = "pagedllm/heartbeat/{rank}"
STORE_PREFIX_TP = "pagedllm/tp"


NONCE_BYTES = 32


class HelloMsg(msgspec.Struct, tag="hello"):
    rank: int
    pid: int
    hostname: str
    nonce: bytes
    """The worker's challenge to the engine."""


class ChallengeMsg(msgspec.Struct, tag="challenge"):
    nonce: bytes
    """The engine's challenge to the worker."""
    proof: bytes
    """engine_proof(secret, the worker's nonce, nonce): the engine knows the secret."""


class AuthMsg(msgspec.Struct, tag="auth"):
    rank: int
    proof: bytes
    """worker_proof(secret, rank, the worker's nonce, the engine's nonce)."""


class RefusedMsg(msgspec.Struct, tag="refused"):
    reason: str


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
    gguf_path: str | None = None
    """The GGUF model_dir was converted from: the rank reads its shard of the weights from it, the
    quantized ones kept quantized (the same path on every host); None: model_dir's safetensors."""
    lora_slots: tuple[int, int, int] | None = None
    """(max_loras, max_lora_rank, max_cpu_loras) when LoRA is on: each rank patches its shard's linears and
    reads an adapter's weights, keeping its own share, the first time a step names it; None: LoRA off."""
    batch_invariant: bool = False
    """EngineArgs.batch_invariant: each rank runs the mode's kernels (model/batch_invariant.py), the compiled
    attention op and the rank-order all-reduce."""
    quant_activations: str = "auto"
    """EngineArgs.quant_activations: the activations of each rank's quantized linears (model/activation_format.py);
    a row-parallel shard quantizes its own 32-wide blocks of x, the blocks one rank would."""


class ReadyMsg(msgspec.Struct, tag="ready"):
    rank: int
    num_kv_heads: int
    """KV heads in this rank's cache (checked against the engine's sizing)."""
    sliding_window: int | None = None
    """The window every layer of this rank's model shares (kv_cache_sizing.shared_sliding_window)."""


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
    kv_spilled: list[bytes] | None = None
    """The other ranks' shards of SchedulerOutput.kv_spill's blocks (the disk tier keeps every rank's)."""


class WorkerErrorMsg(msgspec.Struct, tag="error"):
    rank: int
    message: str


ToWorker = Union[ChallengeMsg, RefusedMsg, InitWorkerMsg, ExecuteStepMsg, StopWorkerMsg]
FromWorker = Union[HelloMsg, AuthMsg, ReadyMsg, StepDoneMsg, WorkerErrorMsg]


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def engine_proof(secret: str, worker_nonce: bytes, engine_nonce: bytes) -> bytes:
    return _mac(secret, b"engine", worker_nonce, engine_nonce)


def worker_proof(secret: str, rank: int, worker_nonce: bytes, engine_nonce: bytes) -> bytes:
    return _mac(secret, b"worker", rank.to_bytes(4, "big"), worker_nonce, engine_nonce)


def proof_matches(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


def _mac(secret: str, *parts: bytes) -> bytes:
    # Every part has a fixed length (6-byte role, 4-byte rank, 32-byte nonces): the message is unambiguous.
    return hmac.new(secret.encode("utf-8"), b"pagedllm-tp-v1|" + b"|".join(parts), hashlib.sha256).digest()

encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
