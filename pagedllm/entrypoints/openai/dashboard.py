"""The live KV block map: GET /dashboard (a page) and GET /dashboard/events (server-sent events).

Served by `pagedllm serve --enable-dashboard` (off by default). The page is plain HTML and JavaScript from
dashboard_page.py: no build step, nothing fetched from elsewhere, so it works offline.

    browser ──GET /dashboard/events──► DashboardFeed.stream ──every EVENT_INTERVAL_S──► the latest maps
                                             │ on the first viewer, then every WATCH_RENEW_S
                                             ▼
                         each engine core: utility watch_kv_map ──► KVMapMsg in its stats (≤ 2/s)
                                                                    ──► ServerMetrics.kv_map_stats[replica]

Nobody watching, no core builds a map: the last viewer's leaving sends unwatch_kv_map (the lease only
matters when the front end dies). With an API key set, the event stream needs the key as a bearer
token; the page (which holds no data) reads it from the URL fragment (/dashboard#key=...), which browsers
never send to the server, and keeps it in sessionStorage.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from pagedllm.entrypoints.openai.auth import find_api_key
from pagedllm.entrypoints.openai.dashboard_page import DASHBOARD_HTML
from pagedllm.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

EVENT_INTERVAL_S = 0.5
"""Least time between two events on one stream (the core publishes at most every KV_MAP_INTERVAL_S = 0.5 s)."""
WATCH_RENEW_S = 3.0
"""How often the cores are told someone still watches (their lease is KV_MAP_LEASE_S = 10 s)."""
HEARTBEAT_S = 5.0
"""An event goes out at least this often, changed or not (so a closed tab is noticed)."""
MAX_STREAMS = 8
"""Concurrent event streams; more get 429."""

_STATS_FIELDS = ("num_running", "num_waiting", "kv_cache_usage", "num_preemptions", "num_swap_outs",
                 "prefix_cache_queries", "prefix_cache_hits", "num_evictions", "num_steps", "num_scheduled_tokens",
                 "kv_num_blocks", "kv_num_used_blocks", "kv_num_cached_blocks", "kv_num_empty_blocks",
                 "kv_num_filled_slots", "kv_num_allocated_slots", "kv_num_shared_blocks", "kv_num_saved_blocks",
                 "kv_saved_bytes", "kv_num_host_blocks", "kv_num_swapped_blocks", "kv_blocks_by_priority",
                 "kv_disk_hit_tokens", "kv_disk_miss_blocks", "kv_disk_stored_blocks", "kv_disk_corrupt_blocks",
                 "kv_disk_load_seconds", "kv_disk_store_seconds", "kv_disk_blocks", "kv_disk_bytes", "kv_disk_max_bytes",
                 "kv_disk_num_loading")
"""The gauges sent with each replica's map (taken with it, in the same step) and as engine-wide totals now."""


def _gauges(stats) -> dict:
    return {name: getattr(stats, name) for name in _STATS_FIELDS}


class DashboardFeed:
    """Keeps the engine cores publishing block maps while anyone watches, and streams them as events."""

    def __init__(self, engine, metrics, lifecycle=None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.num_streams = 0
        self._renew_task: asyncio.Task | None = None
        self._encoder = msgspec.json.Encoder()

    def core_clients(self) -> list:
        """One client per engine core: the replicas of a data-parallel client, else the client itself."""
        client = self.engine.client
        return list(getattr(client, "replicas", None) or [client])

    def watch(self) -> None:
        """Ask every core for block maps (a lease it renews by itself for KV_MAP_LEASE_S)."""
        self._tell_cores("watch_kv_map")

    def unwatch(self) -> None:
        """Tell every core that nobody watches: no more maps, rather than until the lease runs out."""
        self._tell_cores("unwatch_kv_map")

    def _tell_cores(self, method: str) -> None:
        for client in self.core_clients():
            try:
                client.request_utility(method)
            except Exception as e:  # a dead replica has no map to give; the others still do
                logger.debug("%s not sent: %s", method, e)

    async def _renew(self) -> None:
        while self.num_streams > 0:
            await asyncio.sleep(WATCH_RENEW_S)
            if self.num_streams > 0:
                self.watch()

    def event(self) -> bytes:
        """One event: every replica's latest map with its gauges of that moment, and the engine-wide totals now."""
        latest = self.engine.latest_stats
        replicas = sorted(self.metrics.kv_map_stats.items(), key=lambda item: int(item[0]))
        body = {"time": time.time(),
                "replicas": [{"replica": replica, "map": stats.kv_map, "stats": _gauges(stats)}
                             for replica, stats in replicas],
                "stats": None if latest is None else _gauges(latest)}
        return b"data: " + self._encoder.encode(body) + b"\n\n"

    def _stopping(self) -> bool:
        return (self.lifecycle is not None and self.lifecycle.draining) or self.engine.dead_error is not None

    async def stream(self):
        """The event stream of one viewer: an event when a map changed, at most every EVENT_INTERVAL_S."""
        self.num_streams += 1
        if self.num_streams == 1:  # the first viewer (again): the last one's leaving ended the watch
            self.watch()
        if self._renew_task is None or self._renew_task.done():
            self._renew_task = asyncio.get_running_loop().create_task(self._renew())
        try:
            sent_key, sent_at = None, 0.0
            yield b"retry: 2000\n\n"
            while not self._stopping():
                key = tuple((replica, s.kv_map.timestamp) for replica, s in self.metrics.kv_map_stats.items())
                now = time.monotonic()
                if key != sent_key or now - sent_at >= HEARTBEAT_S:
                    yield self.event()
                    sent_key, sent_at = key, now
                await asyncio.sleep(EVENT_INTERVAL_S)
        finally:
            self.num_streams -= 1
            if self.num_streams == 0 and not self._stopping():
                self.unwatch()


def add_dashboard_routes(app: FastAPI, engine, metrics, api_keys: tuple[str, ...], lifecycle=None) -> DashboardFeed:
    """Register GET /dashboard and GET /dashboard/events on `app`."""
    feed = DashboardFeed(engine, metrics, lifecycle)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return HTMLResponse(DASHBOARD_HTML, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request):
        if api_keys and find_api_key(request, api_keys) is None:
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if feed.num_streams >= MAX_STREAMS:
            raise APIError(429, f"at most {MAX_STREAMS} dashboards may watch at once", code="too_many_dashboards")
        return StreamingResponse(feed.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return feed
