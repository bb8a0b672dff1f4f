"""The server's life around its requests: draining on SIGTERM, exiting when the engine core dies, and the
replicas' health. What each request meets on its way in (ids, the drain gate, timeouts) is ``http_intake.py``.

    SIGTERM ─► draining: /health and new requests get 503 ─► in-flight requests finish, or at
               --shutdown-timeout are ended (error event, [DONE]) ─► uvicorn stops ─► core stops
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from pagedllm.engine.async_llm import AsyncLLM, EngineStoppingError

logger = logging.getLogger(__name__)

_ABORTED_GRACE_S = 3.0
"""After the shutdown timeout, how long ended requests get to send their last event."""


class Lifecycle:
    """Whether the server is draining, and how many requests are in flight (counted by http_intake.DrainMiddleware)."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0


class PagedLLMServer(uvicorn.Server):
    """uvicorn, with a SIGTERM/SIGINT that drains instead of cutting streams after a fixed 5 s
    (a second signal stops at once), and an exit on engine-core death unless told to keep alive."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, engine: AsyncLLM, shutdown_timeout_s: float,
                 keep_alive_on_engine_death: bool) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        if not keep_alive_on_engine_death:
            engine.on_dead = self._on_engine_dead

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()  # where a signal hands the drain over to
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:  # a signal handler: only hand over to the loop
        if self.lifecycle.draining:
            logger.warning("second signal %d: stopping without waiting for requests", sig)
            self.should_exit = self.force_exit = True
            return
        self.lifecycle.draining = True
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info("draining: %d requests in flight get up to %g s to finish", self.lifecycle.num_in_flight,
                    self.shutdown_timeout_s)
        if not await self._wait_idle(self.shutdown_timeout_s):
            num_ended = self.engine.abort_all(EngineStoppingError(
                f"the server is shutting down and ended this request after its {self.shutdown_timeout_s:g} s "
                f"drain timeout"))
            logger.warning("drain timeout: ended %d unfinished requests", num_ended)
            if self.engine.metrics is not None:
                for _ in range(num_ended):
                    self.engine.metrics.record_rejected("shutdown")
            await self._wait_idle(_ABORTED_GRACE_S)
        self.should_exit = True

    async def _wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.lifecycle.num_in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _on_engine_dead(self, error) -> None:
        logger.error("the engine core died (%s): exiting so a supervisor can restart the server "
                     "(--keep-alive-on-engine-death to keep answering 503 instead)", error)
        self.exit_code = 1
        self.lifecycle.draining = True
        # in-flight requests already got their 503 / error event; let those be written first
        asyncio.get_running_loop().call_later(0.5, setattr, self, "should_exit", True)


def replica_health(engine: AsyncLLM) -> tuple[int, dict] | None:
    """With data-parallel replicas: (status, body) of /health. 200 "ok" when all are up, 200 "degraded"
    while some are down or restarting, 503 when none is up. None for a single engine core."""
    client = engine.client
    states = getattr(client, "states", None)
    if states is None:
        return None
    replicas = [{"replica": i, "state": state.value} for i, state in enumerate(states)]
    num_up = sum(r["state"] == "up" for r in replicas)
    if num_up == 0:
        return 503, {"status": "unhealthy", "message": "no engine replica is up", "replicas": replicas}
    return 200, {"status": "ok" if num_up == len(replicas) else "degraded", "replicas": replicas}


