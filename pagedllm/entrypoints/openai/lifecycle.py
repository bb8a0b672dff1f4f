"""The server's life around its requests: request ids, draining on SIGTERM, exiting when the engine
core dies, and closing connections that never finish their headers.

    SIGTERM ─► draining: /health and new requests get 503 ─► in-flight requests finish, or at
               --shutdown-timeout are ended (error event, [DONE]) ─► uvicorn stops ─► core stops
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.engine.async_llm import AsyncLLM, EngineStoppingError
from pagedllm.entrypoints.openai.errors import APIError, current_request_id, internal_error

logger = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_ABORTED_GRACE_S = 3.0
"""After the shutdown timeout, how long ended requests get to send their last event."""


class RequestIdMiddleware:
    """Take the client's X-Request-Id (if sane) or make one; echo it on the response and expose it
    to handlers (errors.current_request_id), so a 500 can name it. An unhandled exception becomes
    that 500 here (inside, where the id is still known), its text going to the log only."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        token = current_request_id.set(request_id)

        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s failed", request_id)
            if started:  # too late for a status; the connection is cut
                raise
            await internal_error().response()(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


class Lifecycle:
    """Whether the server is draining, and how many requests are in flight (see DrainMiddleware)."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0


class DrainMiddleware:
    """Counts the requests in flight in `lifecycle`; once draining, answers new ones (and /health) 503."""

    def __init__(self, app, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining and scope.get("path") != "/metrics":
            response = APIError(503, "the server is shutting down", code="server_shutting_down",
                                headers={"Connection": "close"}).response()
            await response(scope, receive, send)
            return
        self.lifecycle.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.num_in_flight -= 1


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

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

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


def h11_protocol_with_header_timeout(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a complete request head within
    `timeout_s` of connecting or of finishing its previous response (uvicorn waits forever)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._busy():
                self._arm_header_timer()  # a request head is (partly) pending
            else:
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self._busy():
                self.transport.close()

        def _busy(self) -> bool:
            """A request head has arrived and its response is not complete."""
            return self.cycle is not None and not self.cycle.response_complete

    return HeaderTimeoutH11Protocol
