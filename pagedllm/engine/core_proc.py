"""EngineCoreProc: the engine core in its own process, a busy loop behind two ZMQ sockets.

    front end  --PUSH--> input socket  --> [poll, add/abort] -> step() -> output socket --PUSH--> front end

The loop polls its input without blocking while it has work and blocks in short slices when
idle. On going idle it checks that every KV block is free or cached and reports what it finds.
A fatal error is sent as an EngineDeadMsg before exiting.

While a front end watches the block map (utility `watch_kv_map`, renewed within KV_MAP_LEASE_S,
ended by `unwatch_kv_map`), the stats after a step carry a KVMapMsg at most every KV_MAP_INTERVAL_S;
unwatched, none is built.

A watchdog thread notices the death of the front end, busy or not: it asks the loop to stop,
and if the loop has not ended within a grace period (a long step, a hung collective) it removes
the socket directory and ends the process itself. Nobody is left to read the outputs anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_interface import KVCacheManagerFactory, plugged_kv_cache_manager
from pagedllm.engine.core import EngineCore
from pagedllm.engine.ipc_dirs import ipc_dir_of, remove_ipc_dir
from pagedllm.engine.protocol import (
    AbortRequestsMsg,
    AddRequestMsg,
    EngineDeadMsg,
    EngineStatsMsg,
    FrontendMessage,
    OutputsMsg,
    ReadyMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    UtilityRequestMsg,
    UtilityResultMsg,
)
from pagedllm.errors import InvalidRequestError
from pagedllm.worker.host_memory import configure_malloc

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500
"""How long one idle wait lasts before the loop checks whether it was asked to stop."""
_SEND_LINGER_MS = 2000
PARENT_POLL_S = 0.25
"""How often the watchdog checks that the front-end process is still there."""
PARENT_DEATH_GRACE_S = 2.0
"""How long the loop may take to stop by itself once the front end is gone."""
KV_MAP_INTERVAL_S = 0.5
"""Least time between two published block maps (the dashboard's rate is bounded here, in the core)."""
KV_MAP_LEASE_S = 10.0
"""How long one watch_kv_map keeps the maps coming."""


class EngineCoreProc:
    """Owns an EngineCore and the core side of the sockets. The constructor returns; run_busy_loop() loops."""

    def __init__(self, engine_args: EngineArgs, input_address: str, output_address: str) -> None:
        self._ctx = zmq.Context()
        self.output_socket = self._ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.LINGER, _SEND_LINGER_MS)
        self.output_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket.connect(output_address)
        self.input_socket = self._ctx.socket(zmq.PULL)
        self.input_socket.setsockopt(zmq.RCVHWM, 0)
        self.input_socket.connect(input_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self._parent_pid = os.getppid()
        self._ipc_dir = ipc_dir_of(input_address)
        self.parent_gone = threading.Event()
        self._shutdown_requested = False
        self._num_kv_leaks = 0
        self._kv_map_until = 0.0
        """time.monotonic() until which block maps are published (0: nobody watches)."""
        self._kv_map_last = 0.0
        self.core: EngineCore | None = None
        self._engine_args = engine_args

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Load the model and announce readiness (an EngineDeadMsg if loading fails)."""
        self.core = EngineCore(self._engine_args)
        info = self.core.model_info
        self._send(ReadyMsg(
            model_path=info.model_path,
            max_model_len=self.core.scheduler_config.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            num_blocks=self.core.num_blocks,
            block_size=self.core.kv_info.block_size,
        ))

    def run_busy_loop(self) -> None:
        """Poll input, step, send outputs, until a ShutdownMsg arrives or the parent goes away."""
        core = self.core
        assert core is not None, "call start() first"
        idle_checked = False
        while not self._shutdown_requested:
            if not core.has_unfinished_requests():
                if not idle_checked:
                    self._check_idle_leaks()
                    idle_checked = True
                if not self._wait_for_input():
                    continue
            self._drain_input()
            if core.has_unfinished_requests():
                outputs = core.step()
                self._send(OutputsMsg(outputs, self._stats(), time.monotonic()))
                idle_checked = False

    def close(self) -> None:
        """Stop the executor, close the sockets, flushing what was already sent (idempotent); without a
        front end, nothing is flushed and the socket directory is removed."""
        if self.core is not None:
            self.core.shutdown()
        if not self._ctx.closed:
            self.input_socket.close(linger=0)
            self.output_socket.close(linger=0 if self.parent_gone.is_set() else None)
            self._ctx.term()
        if self.parent_gone.is_set() and self._ipc_dir is not None:
            remove_ipc_dir(self._ipc_dir)

    def start_parent_watchdog(self, poll_s: float = PARENT_POLL_S, grace_s: float = PARENT_DEATH_GRACE_S) -> None:
        """Exit within poll_s + grace_s of the front end's death, whatever the loop is doing."""
        threading.Thread(target=self._watch_parent, args=(poll_s, grace_s), name="parent-watchdog",
                         daemon=True).start()

    def _watch_parent(self, poll_s: float, grace_s: float) -> None:
        while os.getppid() == self._parent_pid:
            time.sleep(poll_s)
        logger.warning("the front-end process went away; engine core exiting")
        self.parent_gone.set()
        self._shutdown_requested = True  # the loop stops after its current step
        time.sleep(grace_s)
        logger.error("the engine core did not stop within %.1f s of its front end's death; ending it", grace_s)
        if self._ipc_dir is not None:
            remove_ipc_dir(self._ipc_dir)
        os._exit(1)

    # --- input ------------------------------------------------------------------------

    def _wait_for_input(self) -> bool:
        """Block up to one idle slice; returns whether input is waiting."""
        return bool(self.input_socket.poll(_IDLE_POLL_MS, zmq.POLLIN))

    def _drain_input(self) -> None:
        while not self._shutdown_requested:
            try:
                frame = self.input_socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self._decoder.decode(frame.buffer))

    def _handle(self, msg) -> None:
        core = self.core
        if isinstance(msg, AddRequestMsg):
            try:
                core.add_request(msg.request)
            except InvalidRequestError as e:
                self._send(RequestRejectedMsg(msg.request.req_id, str(e)))
            except Exception as e:  # this request fails alone
                logger.exception("adding request %s failed", msg.request.req_id)
                self._send(RequestRejectedMsg(msg.request.req_id, f"{type(e).__name__}: {e}", False))
        elif isinstance(msg, AbortRequestsMsg):
            core.abort_requests(msg.req_ids, msg.status)
        elif isinstance(msg, UtilityRequestMsg):
            self._send(self._run_utility(msg))
        elif isinstance(msg, ShutdownMsg):
            self._shutdown_requested = True

    def _run_utility(self, msg: UtilityRequestMsg) -> UtilityResultMsg:
        if msg.method == "stats":
            return UtilityResultMsg(msg.call_id, self._stats())
        if msg.method == "check_kv_leaks":
            return UtilityResultMsg(msg.call_id, self.core.check_kv_leaks())
        if msg.method == "ping":
            return UtilityResultMsg(msg.call_id, "pong")
        if msg.method == "watch_kv_map":
            watched = self._kv_map_until > time.monotonic()
            self._kv_map_until = time.monotonic() + KV_MAP_LEASE_S
            if not watched:  # a first look gets a map at once, busy or idle
                self._kv_map_last = 0.0
                self._send(OutputsMsg([], self._stats(), time.monotonic()))
            return UtilityResultMsg(msg.call_id, KV_MAP_LEASE_S)
        if msg.method == "unwatch_kv_map":
            self._kv_map_until = 0.0
            return UtilityResultMsg(msg.call_id, None)
        return UtilityResultMsg(msg.call_id, error=f"unknown utility method {msg.method!r}")

    # --- output -----------------------------------------------------------------------

    def _send(self, msg) -> None:
        if self.parent_gone.is_set():
            return  # nobody reads it; a full queue to a dead peer must not block the exit
        self.output_socket.send(self._encoder.encode(msg), copy=False)

    def _stats(self) -> EngineStatsMsg:
        stats = msgspec.structs.replace(self.core.stats(), num_kv_leaks=self._num_kv_leaks)
        now = time.monotonic()
        if now < self._kv_map_until and now - self._kv_map_last >= KV_MAP_INTERVAL_S:
            self._kv_map_last = now
            stats.kv_map = self.core.kv_map()
        return stats

    def _check_idle_leaks(self) -> None:
        problems = self.core.check_kv_leaks()
        if problems:
            logger.error("KV cache leak while idle: %s", "; ".join(problems))
        self._num_kv_leaks = len(problems)
        self._kv_map_last = 0.0  # a watcher sees the idle pool, however recent the last map
        self._send(OutputsMsg([], self._stats(), time.monotonic()))


def _raise_system_exit(signum, frame) -> None:
    raise SystemExit(0)


def run_engine_core(engine_args: EngineArgs, input_address: str, output_address: str,
                    log_level: str = "INFO", plugged: KVCacheManagerFactory | None = None) -> None:
    """Process entry point: load, announce readiness, loop; a fatal error becomes an EngineDeadMsg.

    `plugged`: the KV cache manager factory plugged in where this process was spawned
    (core/kv_cache_interface.py), plugged in here too."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s [core]: %(message)s")
    signal.signal(signal.SIGTERM, _raise_system_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop
    configure_malloc()  # before loading: the weights' repacking temporaries are the first to leave the heap
    proc = EngineCoreProc(engine_args, input_address, output_address)
    proc.start_parent_watchdog()  # also while the model loads
    exit_code = 0
    try:
        with plugged_kv_cache_manager(plugged):
            proc.start()
        proc.run_busy_loop()
    except SystemExit:
        logger.info("engine core stopping on a signal")
    except BaseException as e:
        logger.exception("engine core failed")
        summary = "".join(traceback.format_exception_only(type(e), e)).strip()
        try:
            proc._send(EngineDeadMsg(f"engine core failed: {summary}"))
        except Exception:
            pass
        exit_code = 1
    finally:
        proc.close()
    sys.exit(exit_code)
