"""DPCoreClient: N engine-core replicas behind one front end, with MPCoreClient's surface.

    AsyncLLM ── DPCoreClient ── DPRouter (which replica)
                    ├── replica 0: MPCoreClient (local process) or RayCoreClient (Ray actor) ──ZMQ── core
                    └── replica 1: ...                                                        ──ZMQ── core
                    one reader task per replica ─► one merged queue ─► get_output()

Each request goes to one replica and stays there: its id (and its sequences' ids) map to that replica,
so aborts and stop-string stops go where it runs. The messages keep their protocol types; OutputsMsg
stats are rewritten to totals over the replicas (each replica's own go to the metrics, label `replica`).

Faults. A replica whose core dies leaves the routing set at once. Its in-flight requests that have not
produced a token yet are re-sent to another replica (once; the client never saw anything of them);
the others fail with ReplicaDeadError (HTTP 503). A Ray replica is restarted by Ray and rejoins when
its new core reports ready; a local one stays down. get_output() raises EngineDeadError only once no
replica is up and none is being restarted: until then the server keeps serving with what is left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging

import msgspec
import zmq

from pagedllm.config import EngineArgs
from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.engine.core_client import MPCoreClient
from pagedllm.engine.dp_router import DPRouter, NoReplicaUpError
from pagedllm.engine.dp_stats import STATS_MERGE, StatsMerge, merge_stats, retire, retired_counters  # noqa: F401
from pagedllm.engine.protocol import (
    CoreMessage,
    EngineStatsMsg,
    OutputsMsg,
    ReadyMsg,
    RequestRejectedMsg,
)
from pagedllm.errors import EngineDeadError

logger = logging.getLogger(__name__)


class ReplicaDeadError(EngineDeadError):
    """The replica serving this request died after it had sent output; other replicas still serve."""


class ReplicaState(str, enum.Enum):
    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"
    DOWN = "down"


@dataclasses.dataclass(slots=True)
class ReplicaLostMsg:
    """Front-end-only (never crosses a socket): request `req_id` failed because its replica died."""

    req_id: str
    error: EngineDeadError


@dataclasses.dataclass(slots=True)
class _InFlight:
    request: EngineCoreRequest
    replica: int
    seq_ids: set[str]
    started: bool = False
    """An output (a token, or a finish) came back: it can no longer be silently re-run elsewhere."""
    num_retries: int = 0


class DPCoreClient:
    """Several cores behind one client. Construct, `await wait_ready()`, then use like MPCoreClient."""

    def __init__(self, engine_args: EngineArgs, log_level: str = "INFO", metrics=None,
                 replicas: list | None = None) -> None:
        """replicas: clients already made (tests); default: start data_parallel_size of them."""
        config = engine_args.parallel_config()
        self.num_replicas = config.data_parallel_size
        self.metrics = metrics
        self._engine_args = engine_args
        self.router = DPRouter(self.num_replicas, config.routing, engine_args.block_size,
                               config.routing_affinity_blocks, config.routing_max_imbalance)
        self.states = [ReplicaState.STARTING] * self.num_replicas
        self.ready_msgs: list[ReadyMsg | None] = [None] * self.num_replicas
        self.replica_stats: list[EngineStatsMsg | None] = [None] * self.num_replicas
        self._retired = retired_counters()
        """Counters of replica incarnations that died: totals never go backwards."""
        self._inflight: dict[str, _InFlight] = {}
        self._seq_owner: dict[str, str] = {}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._readers: list[asyncio.Task] = []
        self.dead_error: EngineDeadError | None = None
        self._closed = False
        if replicas is not None:
            self.replicas = replicas
        elif config.uses_ray:
            from pagedllm.engine.ray_replica import start_ray_replicas

            self.replicas = start_ray_replicas(engine_args, config, log_level)
        else:
            self.replicas = [MPCoreClient(engine_args, log_level) for _ in range(self.num_replicas)]
        for i in range(self.num_replicas):
            self._set_metric_up(i, False)

    # --- start-up -------------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float = 900.0) -> ReadyMsg:
        """Wait for every replica's model; returns one ReadyMsg whose num_blocks is the total."""
        try:
            readies = await asyncio.gather(*(r.wait_ready(timeout_s) for r in self.replicas))
        except BaseException:
            self.shutdown()
            raise
        for i, ready in enumerate(readies):
            self._mark_up(i, ready)
        self._readers = [asyncio.get_running_loop().create_task(self._read(i)) for i in range(self.num_replicas)]
        first = readies[0]
        return msgspec.structs.replace(first, num_blocks=sum(r.num_blocks for r in readies))

    # --- sending --------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Route a request to a replica and send it. Raises EngineDeadError when no replica is up."""
        self._check_open()
        if request.req_id in self._inflight:
            raise AssertionError(f"request {request.req_id} is already in flight")
        self._dispatch(_InFlight(request, -1, set(request.sampling_params.sequence_req_ids(request.req_id))))

    def _dispatch(self, entry: _InFlight) -> None:
        while True:
            try:
                lora = entry.request.lora_request
                decision = self.router.route(entry.request.prompt_token_ids, entry.request.cache_salt,
                                             lora.cache_key if lora is not None else None)
            except NoReplicaUpError:
                raise EngineDeadError(f"no engine replica is up ({self._describe_states()})") from None
            try:
                self.replicas[decision.replica].add_request(entry.request)
            except (EngineDeadError, zmq.ZMQError) as e:  # died since we last looked: try the others
                self._mark_down(decision.replica, EngineDeadError(str(e)))
                continue
            entry.replica = decision.replica
            self._inflight[entry.request.req_id] = entry
            for seq_id in entry.seq_ids:
                self._seq_owner[seq_id] = entry.request.req_id
            self.router.on_sent(decision.replica, len(entry.seq_ids))
            if self.metrics is not None:
                self.metrics.record_routing(str(decision.replica), decision.reason.value)
            return

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort these core request (sequence) ids on the replicas that hold them; unknown ids are ignored."""
        by_replica: dict[int, list[str]] = {}
        for seq_id in req_ids:
            entry = self._forget_seq(seq_id)
            if entry is not None:
                by_replica.setdefault(entry.replica, []).append(seq_id)
        for replica, seq_ids in by_replica.items():
            try:
                self.replicas[replica].abort_requests(seq_ids, status)
            except (EngineDeadError, zmq.ZMQError):
                pass  # a dead replica holds nothing any more

    def _check_open(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("the engine core client is shut down")

    # --- receiving ------------------------------------------------------------------------

    async def get_output(self) -> CoreMessage | ReplicaLostMsg:
        """The next message of any replica (stats are totals). Raises EngineDeadError once none is left."""
        self._check_open()
        msg = await self._queue.get()
        if isinstance(msg, EngineDeadError):
            self.dead_error = msg
            raise msg
        return msg

    async def _read(self, i: int) -> None:
        replica = self.replicas[i]
        while True:
            try:
                msg = await replica.get_output()
            except EngineDeadError as e:
                self._mark_down(i, e)
                if not await self._wait_restarted(i):
                    self._check_any_left()
                    return
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug here must not leave this replica's requests hanging
                logger.exception("reading replica %d failed", i)
                self._mark_down(i, EngineDeadError(f"reading replica {i} failed: {e}"), can_restart=False)
                self._check_any_left()
                return
            self._on_message(i, msg)

    def _on_message(self, i: int, msg) -> None:
        if isinstance(msg, OutputsMsg):
            outputs = []
            for out in msg.outputs:
                owner = self._seq_owner.get(out.req_id)
                entry = self._inflight.get(owner) if owner is not None else None
                if entry is None or entry.replica != i:
                    continue  # aborted here already, or a stale output of an earlier incarnation
                entry.started = True
                if out.finish_reason is not None:
                    self._forget_seq(out.req_id)
                outputs.append(out)
            if msg.stats is not None:
                self.replica_stats[i] = msg.stats
                if self.metrics is not None:
                    self.metrics.record_replica_stats(str(i), msg.stats)
            if outputs or msg.stats is not None:
                self._queue.put_nowait(OutputsMsg(outputs, self.total_stats(), msg.timestamp))
        elif isinstance(msg, RequestRejectedMsg):
            entry = self._inflight.get(msg.req_id)
            if entry is not None and entry.replica == i:
                for seq_id in list(entry.seq_ids):
                    self._forget_seq(seq_id)
                self._queue.put_nowait(msg)
        elif isinstance(msg, ReadyMsg):
            pass  # a restart's ReadyMsg is consumed by wait_restarted
        else:
            self._queue.put_nowait(msg)

    def _forget_seq(self, seq_id: str) -> _InFlight | None:
        owner = self._seq_owner.pop(seq_id, None)
        entry = self._inflight.get(owner) if owner is not None else None
        if entry is None:
            return None
        entry.seq_ids.discard(seq_id)
        self.router.on_finished(entry.replica, 1)
        if not entry.seq_ids:
            del self._inflight[owner]
        return entry

    # --- faults ---------------------------------------------------------------------------

    def _mark_up(self, i: int, ready: ReadyMsg) -> None:
        self.states[i] = ReplicaState.UP
        self.ready_msgs[i] = ready
        self.router.set_up(i, True)
        self._set_metric_up(i, True)

    def _mark_down(self, i: int, error: EngineDeadError, can_restart: bool | None = None) -> None:
        if self.states[i] in (ReplicaState.DOWN, ReplicaState.RESTARTING):
            return
        if can_restart is None:
            can_restart = getattr(self.replicas[i], "can_restart", False)
        logger.error("engine replica %d is down (%s)%s", i, error, "; waiting for its restart" if can_restart else "")
        self.states[i] = ReplicaState.RESTARTING if can_restart else ReplicaState.DOWN
        self.router.set_up(i, False)
        self._set_metric_up(i, False)
        last = self.replica_stats[i]
        if last is not None:
            retire(self._retired, last)
        self.replica_stats[i] = None
        lost = [entry for entry in self._inflight.values() if entry.replica == i]
        for entry in lost:
            for seq_id in entry.seq_ids:
                self._seq_owner.pop(seq_id, None)
            del self._inflight[entry.request.req_id]
        for entry in lost:
            self._retry_or_fail(entry, i, error)

    def _retry_or_fail(self, entry: _InFlight, i: int, error: EngineDeadError) -> None:
        req_id = entry.request.req_id
        if not entry.started and entry.num_retries == 0 and self.router.num_up > 0:
            entry.num_retries += 1
            entry.seq_ids = set(entry.request.sampling_params.sequence_req_ids(req_id))
            try:
                self._dispatch(entry)
                logger.warning("request %s re-sent to replica %d: replica %d died before its first token",
                               req_id, entry.replica, i)
                if self.metrics is not None:
                    self.metrics.record_replica_request_lost(str(i), "retried")
                return
            except EngineDeadError:
                pass
        if self.metrics is not None:
            self.metrics.record_replica_request_lost(str(i), "failed")
        self._queue.put_nowait(ReplicaLostMsg(req_id, ReplicaDeadError(
            f"engine replica {i} died while serving this request ({error}); retry it: the other replicas serve")))

    async def _wait_restarted(self, i: int) -> bool:
        replica = self.replicas[i]
        if self.states[i] is not ReplicaState.RESTARTING or self._closed:
            return False
        try:
            ready = await replica.wait_restarted()
        except EngineDeadError as e:
            logger.error("engine replica %d did not come back: %s", i, e)
            self.states[i] = ReplicaState.DOWN
            return False
        logger.warning("engine replica %d is back", i)
        if self.metrics is not None:
            self.metrics.record_replica_restart(str(i))
        self._mark_up(i, ready)
        return True

    def _check_any_left(self) -> None:
        if all(s is ReplicaState.DOWN for s in self.states):
            self._queue.put_nowait(EngineDeadError(f"every engine replica is down ({self._describe_states()})"))

    # --- health and stats -------------------------------------------------------------------

    def is_alive(self) -> bool:
        """True while some replica is up or coming back."""
        return any(s is not ReplicaState.DOWN for s in self.states) and self.dead_error is None

    @property
    def num_up(self) -> int:
        return sum(s is ReplicaState.UP for s in self.states)

    def _describe_states(self) -> str:
        return ", ".join(f"replica {i} {s.value}" for i, s in enumerate(self.states))

    def total_stats(self) -> EngineStatsMsg:
        """The engine-wide view: every field merged over the replicas as STATS_MERGE says (dp_stats.py)."""
        live = [(s, self.ready_msgs[i].num_blocks) for i, s in enumerate(self.replica_stats) if s is not None]
        return merge_stats(live, self._retired)

    def _set_metric_up(self, i: int, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.record_replica_up(str(i), up)

    # --- shutdown -------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every replica (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for task in self._readers:
            task.get_loop().call_soon_threadsafe(task.cancel)
        for replica in self.replicas:
            replica.shutdown(timeout_s)
        if getattr(self.replicas[0], "can_restart", False):
            from pagedllm.engine.ray_replica import shutdown_ray

            shutdown_ray()
