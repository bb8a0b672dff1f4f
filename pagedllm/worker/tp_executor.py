"""MultiprocTPExecutor: N tensor-parallel ranks in worker processes (tp_worker.py), one rank each.

It hosts the torch.distributed rendezvous store, starts the local ranks (ranks >= num_local join from
other hosts after proving the distributed secret), sends every rank the same encoded ``SchedulerOutput``
(but for the KV disk tier's loads: each rank gets its own shard of each block) and returns rank 0's
``ModelRunnerOutput``, checking the other ranks sampled the same tokens (and joining the ranks' shards
of the blocks spilled to disk).

Failure: while it waits it polls the local processes and every rank's heartbeat counter in the
store; a worker that dies, stops beating, reports an error or misses the step deadline makes the
executor stop every worker and raise ``EngineDeadError`` naming the rank. After that every call
raises the same error.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
import weakref
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
import zmq

from pagedllm.config import (
    DISTRIBUTED_SECRET_ENV,
    CacheConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.errors import EngineDeadError
from pagedllm.model import activation_format
from pagedllm.model.loader import gguf_weights_source, load_model_info
from pagedllm.worker import tp_protocol as proto
from pagedllm.worker.interface import Executor, KVCacheInfo, ModelInfo
from pagedllm.worker.kv_cache import KVCacheSpec, num_kv_blocks
from pagedllm.worker.kv_cache_sizing import kv_cache_info, with_default_kv_memory

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 10.0
_POLL_MS = 100


class _WorkerFailure(Exception):
    """Internal: the message becomes the EngineDeadError's."""


def _stop_processes(procs: dict[int, subprocess.Popen], grace_s: float = 2.0) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _shard(payload: bytes, rank: int, num_ranks: int) -> bytes:
    size = len(payload) // num_ranks
    return payload[rank * size : (rank + 1) * size]


class MultiprocTPExecutor(Executor):
    """N tensor-parallel ranks in worker processes; ranks >= num_local_workers join from elsewhere."""

    gguf_path: str | None = None
    """The GGUF the ranks read their quantized shards from (as load_model would), or None."""
    lora_slots: tuple[int, int, int] | None = None
    """(max_loras, max_lora_rank, max_cpu_loras) for the ranks' LoRA managers when LoRA is on, else None."""
    batch_invariant: bool = False
    """DeviceConfig.batch_invariant, for the ranks' runners."""
    quant_activations: str = "auto"
    """ModelConfig.quant_activations, for the ranks' loads."""

    def __init__(self, model_config: ModelConfig, device_config: DeviceConfig, lora: LoRAConfig | None,
                 parallel_config: ParallelConfig, dtype: torch.dtype) -> None:
        # The weights live in the workers: this process reads only the config and tokenizer.
        gguf = gguf_weights_source(model_config.model, dtype, "cpu", model_config.gguf_dequantize)
        # the ranks read a GGUF's weights from the file itself: its directory needs no float32 copy
        self.model_info = ModelInfo.from_loaded(load_model_info(model_config.model, weights=gguf is None))
        self.gguf_path = None if gguf is None else str(gguf.resolve())
        self.lora_slots = None if lora is None else (lora.max_loras, lora.max_lora_rank, lora.num_cpu_loras)
        self.batch_invariant = device_config.batch_invariant
        self.quant_activations = activation_format.for_model(model_config.quant_activations, model_config.model)
        self.parallel_config = parallel_config
        self.seed = device_config.seed
        self.model_name = model_config.model
        self.dtype = dtype
        self.tp_size = parallel_config.tensor_parallel_size
        self.timeout_s = parallel_config.distributed_timeout
        self.heartbeat_timeout_s = min(HEARTBEAT_TIMEOUT_S, self.timeout_s)
        self.kv_spec: KVCacheSpec | None = None
        self.failure: str | None = None
        self._step_id = 0
        self.procs: dict[int, subprocess.Popen] = {}
        # Local-only groups get a random secret of their own; workers from elsewhere need the configured one.
        self._secret = parallel_config.distributed_secret or secrets.token_hex(32)
        self._identities: dict[int, bytes] = {}
        """rank -> the socket identity of the worker that proved the secret for it."""
        self._launched = False
        self._closed = False

    def initialize_kv_cache(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> KVCacheInfo:
        self.kv_spec = spec = KVCacheSpec.for_model(self.model_info.hf_config, cache_config.block_size,
                                                    self.dtype, self.tp_size)
        cache_config = with_default_kv_memory(cache_config, spec.bytes_per_block, scheduler_config.max_model_len,
                                              self.model_name, num_ranks=self.tp_size)
        num_blocks, num_host_blocks = num_kv_blocks(spec, cache_config)
        logger.info("tensor parallel: %d ranks, %d KV heads each", self.tp_size, spec.num_kv_heads)
        window = self._launch(spec, num_blocks, num_host_blocks)
        return kv_cache_info(spec, num_blocks, num_host_blocks, sliding_window=window)

    def _launch(self, kv_spec: KVCacheSpec, num_blocks: int, num_host_blocks: int) -> int | None:
        """Host the rendezvous, start the local ranks and wait until every rank holds its shard; the sliding
        window every rank's layers share (None if one has none)."""
        config = self.parallel_config
        master_addr, tp_size, timeout_s, num_local = (config.master_addr, self.tp_size, self.timeout_s,
                                                      config.num_local)
        # The rendezvous store lives here, so workers on any host need only HOST:PORT.
        self.store = dist.TCPStore(master_addr, config.master_port or 0, None, True,
                                   timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.master_addr, self.master_port = master_addr, self.store.port
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished worker raises
        loopback = master_addr in ("127.0.0.1", "localhost", "::1")
        port = self._sock.bind_to_random_port("tcp://127.0.0.1" if loopback else "tcp://*")
        self.store.set(proto.ENGINE_ADDRESS_KEY, f"tcp://{master_addr}:{port}")
        self._heartbeats: dict[int, tuple[int, float]] = {}
        self._last_liveness_check = 0.0
        self._launched = True

        threads = max(1, (os.cpu_count() or 1) // max(1, num_local))
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        env[DISTRIBUTED_SECRET_ENV] = self._secret  # in the environment, not argv: `ps` shows argv to everyone
        for rank in range(num_local):
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.worker.tp_worker", "--master-addr", master_addr,
                 "--master-port", str(self.master_port), "--rank", str(rank), "--world-size", str(tp_size),
                 "--num-threads", str(threads), "--parent-pid", str(os.getpid()),
                 "--connect-timeout", str(timeout_s),
                 "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())],
                env=env,
            )
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, 0.0)
        if num_local < tp_size:
            logger.info("waiting for ranks %d..%d: start them with 'pagedllm worker --master-addr %s "
                        "--master-port %d --rank R --world-size %d'", num_local, tp_size - 1,
                        master_addr, self.master_port, tp_size)
        try:
            return self._start(self.model_info.model_path, str(self.dtype).removeprefix("torch."), kv_spec,
                               num_blocks, num_host_blocks, self.seed)
        except _WorkerFailure as failure:
            self._die(f"tensor-parallel start-up failed: {failure}")

    # --- start-up --------------------------------------------------------------------------

    def _start(self, model_dir, dtype, kv_spec, num_blocks, num_host_blocks, seed) -> int | None:
        deadline = time.monotonic() + self.timeout_s
        hosts: dict[int, str] = {}
        challenges: dict[bytes, tuple[proto.HelloMsg, bytes]] = {}  # identity -> (hello, engine nonce)
        while len(hosts) < self.tp_size:
            ident, msg = self._recv(deadline, "to join", set(range(self.tp_size)) - set(hosts), heartbeats=False)
            if isinstance(msg, proto.HelloMsg):
                if not 0 <= msg.rank < self.tp_size:
                    self._refuse(ident, f"rank {msg.rank} is outside [0, {self.tp_size})")
                    continue
                nonce = proto.new_nonce()
                challenges[ident] = (msg, nonce)
                self._send_to(ident, proto.ChallengeMsg(nonce, proto.engine_proof(self._secret, msg.nonce, nonce)))
            elif isinstance(msg, proto.AuthMsg) and ident in challenges:
                hello, nonce = challenges.pop(ident)
                expected = proto.worker_proof(self._secret, hello.rank, hello.nonce, nonce)
                if msg.rank != hello.rank or not proto.proof_matches(expected, msg.proof):
                    logger.warning("refused a worker for rank %d (pid %d on %s): wrong distributed secret",
                                   hello.rank, hello.pid, hello.hostname)
                    self._refuse(ident, "wrong distributed secret")
                elif hello.rank in self._identities:
                    self._refuse(ident, f"rank {hello.rank} has already joined")
                else:
                    self._identities[hello.rank] = ident
                    hosts[hello.rank] = hello.hostname
        init = proto.InitWorkerMsg(model_dir=model_dir, dtype=dtype, num_blocks=num_blocks,
                                   num_host_blocks=num_host_blocks, block_size=kv_spec.block_size,
                                   seed=seed, timeout_s=self.timeout_s, gguf_path=self.gguf_path,
                                   lora_slots=self.lora_slots, batch_invariant=self.batch_invariant,
                                   quant_activations=self.quant_activations)
        self._broadcast(proto.encoder.encode(init))
        ready: set[int] = set()
        windows: set[int | None] = set()
        deadline = time.monotonic() + self.timeout_s
        while len(ready) < self.tp_size:
            _, msg = self._recv(deadline, "to load its shard", set(range(self.tp_size)) - ready, heartbeats=False)
            if isinstance(msg, proto.ReadyMsg):
                if msg.num_kv_heads != kv_spec.num_kv_heads:
                    raise _WorkerFailure(f"rank {msg.rank} holds {msg.num_kv_heads} KV heads, "
                                         f"the engine sized its cache for {kv_spec.num_kv_heads}")
                ready.add(msg.rank)
                windows.add(msg.sliding_window)
        now = time.monotonic()
        self._heartbeats = {rank: (-1, now) for rank in range(self.tp_size)}
        logger.info("tensor parallel: %d ranks ready (%s)", self.tp_size,
                    ", ".join(f"rank {r} on {hosts[r]}" for r in sorted(hosts)))
        return windows.pop() if len(windows) == 1 else None

    # --- one step --------------------------------------------------------------------------

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        self._step_id += 1
        step_id = self._step_id
        try:
            if sched.kv_load:
                self._send_shards(step_id, sched)
            else:
                self._broadcast(proto.encoder.encode(proto.ExecuteStepMsg(step_id, sched)))
            pending = set(range(self.tp_size))
            output: ModelRunnerOutput | None = None
            others: dict[int, dict[str, list[int]] | None] = {}
            spilled: dict[int, list[bytes]] = {}
            deadline = time.monotonic() + self.timeout_s + 5.0  # the collective timeout fires first
            while pending:
                _, msg = self._recv(deadline, f"to finish step {step_id}", pending)
                if isinstance(msg, proto.StepDoneMsg) and msg.step_id == step_id:
                    pending.discard(msg.rank)
                    if msg.rank == 0:
                        output = msg.output
                    else:
                        others[msg.rank] = msg.sampled_token_ids
                        spilled[msg.rank] = msg.kv_spilled or []
            assert output is not None
            for rank, sampled in others.items():
                if sampled != output.sampled_token_ids:
                    raise _WorkerFailure(f"rank {rank} sampled {sampled} where rank 0 sampled "
                                         f"{output.sampled_token_ids}: the ranks' logits or seeds differ")
            if sched.kv_spill:  # a block's bytes: every rank's shard, in rank order (core/kv_disk_store.py)
                shards = [output.kv_spilled] + [spilled[rank] for rank in range(1, self.tp_size)]
                if any(len(s) != len(sched.kv_spill) for s in shards):
                    raise _WorkerFailure(f"the ranks copied out {[len(s) for s in shards]} KV blocks, "
                                         f"asked for {len(sched.kv_spill)}")
                output.kv_spilled = [b"".join(parts) for parts in zip(*shards)]
            return output
        except _WorkerFailure as failure:
            self._die(str(failure))
        except zmq.ZMQError as e:
            self._die(f"tensor-parallel messaging failed: {e}")
        raise AssertionError("unreachable")

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Blocks' K/V as bytes, every rank's shard joined in rank order (the disk tier keeps the cached prefixes
        at shutdown): a step that runs nothing and copies them out."""
        return self.execute_model(SchedulerOutput([], [], {}, 0, kv_spill=list(block_ids))).kv_spilled

    def _send_shards(self, step_id: int, sched: SchedulerOutput) -> None:
        """The step to each rank with kv_load cut to that rank's shard of each block (its KV heads)."""
        loads = sched.kv_load
        try:
            for rank, ident in self._identities.items():
                sched.kv_load = [(block_id, _shard(payload, rank, self.tp_size)) for block_id, payload in loads]
                try:
                    self._sock.send_multipart([ident, proto.encoder.encode(proto.ExecuteStepMsg(step_id, sched))])
                except zmq.ZMQError as e:
                    raise _WorkerFailure(self._explain(f"tensor-parallel rank {rank} is unreachable ({e})")) from e
        finally:
            sched.kv_load = loads

    # --- messaging and liveness ------------------------------------------------------------

    def _broadcast(self, payload: bytes) -> None:
        """Send to every rank that joined (all of them, once start-up is past the handshake)."""
        for rank, ident in self._identities.items():
            try:
                self._sock.send_multipart([ident, payload])
            except zmq.ZMQError as e:
                raise _WorkerFailure(self._explain(f"tensor-parallel rank {rank} is unreachable ({e})")) from e

    def _send_to(self, ident: bytes, msg) -> None:
        try:
            self._sock.send_multipart([ident, proto.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a peer gone during the handshake is simply not admitted

    def _refuse(self, ident: bytes, reason: str) -> None:
        self._send_to(ident, proto.RefusedMsg(reason))

    def _recv(self, deadline: float, what: str, waiting_for: set[int],
              heartbeats: bool = True) -> tuple[bytes, object]:
        """The next (sender identity, message) from a worker; raises _WorkerFailure on an error report, a
        death or the deadline. Until a peer has proved the secret only HelloMsg and AuthMsg count from it."""
        joined = set(self._identities.values())
        while True:
            if self._sock.poll(_POLL_MS):
                frames = self._sock.recv_multipart()
                ident = frames[0]
                try:
                    msg = proto.from_worker_decoder.decode(frames[-1]) if len(frames) == 2 else None
                except msgspec.DecodeError:
                    msg = None
                if ident not in joined and not isinstance(msg, (proto.HelloMsg, proto.AuthMsg)):
                    logger.warning("dropped a message from a peer that has not joined (%s)",
                                   type(msg).__name__ if msg is not None else "undecodable")
                    continue
                if msg is None:
                    raise _WorkerFailure("a tensor-parallel worker sent an undecodable message")
                if isinstance(msg, proto.WorkerErrorMsg):
                    raise _WorkerFailure(self._explain(f"tensor-parallel rank {msg.rank} failed: {msg.message}"))
                return ident, msg
            now = time.monotonic()
            if now - self._last_liveness_check >= 0.5:
                self._last_liveness_check = now
                self._check_liveness(heartbeats)
            if now > deadline:
                ranks = ", ".join(map(str, sorted(waiting_for)))
                raise _WorkerFailure(self._explain(
                    f"tensor-parallel rank(s) {ranks} did not reply within {self.timeout_s:.0f} s "
                    f"(waiting for them {what}); hung?"))

    def _check_liveness(self, heartbeats: bool) -> None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise _WorkerFailure(f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code {code}")
        if not heartbeats:
            return
        now = time.monotonic()
        for rank, (count, seen) in self._heartbeats.items():
            current = self.store.add(proto.HEARTBEAT_KEY.format(rank=rank), 0)
            if current != count:
                self._heartbeats[rank] = (current, now)
            elif now - seen > self.heartbeat_timeout_s:
                raise _WorkerFailure(f"tensor-parallel rank {rank} sent no heartbeat for "
                                     f"{now - seen:.0f} s (process or host gone?)")

    def _explain(self, message: str) -> str:
        """Name the root cause: a rank whose process died explains the others' errors."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None and code not in (0, 1):  # 1 = reported its own error
                    return f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code {code}; then {message}"
            time.sleep(0.05)
        return message

    def _die(self, message: str) -> None:
        logger.error("engine dead: %s", message)
        self.failure = message
        self.shutdown()
        raise EngineDeadError(message)

    # --- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._launched:
            self.failure = "the engine was shut down"
            return
        stop = proto.encoder.encode(proto.StopWorkerMsg())
        for ident in self._identities.values():
            try:
                self._sock.send_multipart([ident, stop], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        _stop_processes(self.procs)
        self._finalizer.detach()
        self._sock.close(linger=0)
        self._ctx.term()
        if self.failure is None:
            self.failure = "the engine was shut down"
