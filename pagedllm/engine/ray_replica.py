"""Data-parallel replicas as Ray actors: Ray places them (num_cpus each) and restarts one that dies.

    API server (driver)                                   Ray node (this machine or another)
    RayCoreClient: binds tcp://<driver node ip>:<port> x2 ─────► EngineReplicaActor ── spawns ── EngineCoreProc
                   pings the actor; on death waits for    ◄───── (the core connects to those two endpoints)
                   Ray's restart and the new ReadyMsg

The data path is the same msgspec-over-ZMQ as a local core; only the endpoints are tcp instead of ipc
(ipc paths exist on one machine only), and the front end binds them, so a restarted actor's core
reconnects to the same addresses by itself. Ray carries nothing but the actor's construction arguments.

The actor exits when its core process exits (unless it was told to stop), which is what makes Ray
restart it (at most `ray_max_restarts` times); its core dies with it through the core's parent watchdog.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time

from pagedllm.config import EngineArgs, ParallelConfig
from pagedllm.engine.core_client import MPCoreClient
from pagedllm.engine.protocol import ReadyMsg
from pagedllm.errors import EngineDeadError

logger = logging.getLogger(__name__)

_PING_INTERVAL_S = 0.25
_PING_TIMEOUT_S = 10.0


class EngineReplicaActor:
    """Hosts one engine-core process (and, through it, the replica's tensor-parallel workers)."""

    def __init__(self, engine_args: EngineArgs, input_address: str, output_address: str, log_level: str) -> None:
        from pagedllm.engine.core_proc import run_engine_core

        self._stopping = False
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="pagedllm-engine-core",
            args=(engine_args, input_address, output_address, log_level, None))
        self.process.start()
        threading.Thread(target=self._exit_with_core, name="core-watch", daemon=True).start()

    def _exit_with_core(self) -> None:
        self.process.join()
        if not self._stopping:
            os._exit(1)  # the actor dies with its core, so Ray restarts both

    def ping(self) -> bool:
        """Whether the core process is alive."""
        return self.process.is_alive()

    def core_pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the core for good (no restart follows)."""
        self._stopping = True  # before the core exits, or its exit would look like a death
        self.process.terminate()  # SIGTERM: the core leaves its loop and closes cleanly
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()


class RayCoreClient(MPCoreClient):
    """An MPCoreClient whose core runs in a Ray actor; survives the actor's restarts (wait_restarted)."""

    can_restart = True

    def __init__(self, engine_args: EngineArgs, log_level: str, host: str, actor_cls, actor_options: dict,
                 max_restarts: int) -> None:
        self._actor_cls = actor_cls
        self._actor_options = actor_options
        self._max_restarts = max_restarts
        self._num_deaths = 0
        self._alive = True
        super().__init__(engine_args, log_level, tcp_host=host)
        self._monitor = asyncio.get_running_loop().create_task(self._watch_actor())

    def _start_core(self, engine_args: EngineArgs, log_level: str) -> None:
        self.actor = self._actor_cls.options(**self._actor_options).remote(
            engine_args, self.input_address, self.output_address, log_level)

    async def _watch_actor(self) -> None:
        """Ping the actor: an error (it died, or is restarting) or a dead core marks it down; a slow answer
        (a loaded machine, an actor still starting) changes nothing."""
        import ray.exceptions

        while not self._closed:
            try:
                self._alive = bool(await asyncio.wait_for(self.actor.ping.remote(), _PING_TIMEOUT_S))
            except asyncio.TimeoutError:
                pass
            except (ray.exceptions.RayError, OSError):
                self._alive = False
            await asyncio.sleep(_PING_INTERVAL_S)

    def is_alive(self) -> bool:
        return self._alive

    def _death_reason(self) -> str:
        return "the engine replica's Ray actor or its core process died"

    async def wait_restarted(self, timeout_s: float = 600.0) -> ReadyMsg:
        """After a death: wait for Ray to restart the actor and for its new core's ReadyMsg.
        Raises EngineDeadError once the restarts are used up, or on timeout."""
        self._num_deaths += 1
        if self._num_deaths > self._max_restarts:
            raise EngineDeadError(f"the replica died {self._num_deaths} times; Ray restarts it at most "
                                  f"{self._max_restarts} times")
        deadline = time.monotonic() + timeout_s
        while not self._alive:
            if self._closed or time.monotonic() > deadline:
                raise EngineDeadError("the replica's actor was not restarted in time")
            await asyncio.sleep(_PING_INTERVAL_S)
        self.dead_error = None
        return await self.wait_ready(max(deadline - time.monotonic(), 1.0))

    def _stop_core(self, timeout_s: float) -> None:
        import ray

        self._monitor.get_loop().call_soon_threadsafe(self._monitor.cancel)
        try:
            ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + 5)
        except Exception:
            pass
        ray.kill(self.actor, no_restart=True)


def start_ray_replicas(engine_args: EngineArgs, config: ParallelConfig, log_level: str) -> list[RayCoreClient]:
    """Join (or start) Ray, then start one actor per replica, each asking for one CPU per TP rank."""
    import ray
    import ray.util

    if not ray.is_initialized():
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        # "local": a private instance even when a cluster was `ray start`ed on this machine
        kwargs = {"address": address} if address else {
            "address": "local", "num_cpus": config.data_parallel_size * config.tensor_parallel_size}
        env = {k: os.environ[k] for k in ("PYTHONPATH", "OMP_WAIT_POLICY") if k in os.environ}
        ray.init(include_dashboard=False, runtime_env={"env_vars": env} if env else None,
                 logging_level=logging.WARNING, **kwargs)
    host = ray.util.get_node_ip_address()
    actor_cls = ray.remote(EngineReplicaActor)
    options = {"num_cpus": config.tensor_parallel_size, "max_restarts": config.ray_max_restarts,
               "max_task_retries": 0}
    return [RayCoreClient(engine_args, log_level, host, actor_cls, options, config.ray_max_restarts)
            for _ in range(config.data_parallel_size)]


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
