"""How the front end reaches the engine core: FrontendCore, shared by LLMEngine (offline) and AsyncLLM
(asyncio server), and MPCoreClient, the core in its own process over ZMQ.

    add_request:  prompt ─ InputProcessor ─> EngineCoreRequest ─ OutputProcessor (register) ─> core
    outputs:      core outputs ─ OutputProcessor (text, stop strings, n) ─> RequestOutputs
                                 └─ stop strings found here ─> core.abort_requests(FINISHED_STOPPED)

The two front ends differ only in what `core` is (an in-process EngineCore, or an MPCoreClient) and in
how they deliver RequestOutputs (returned from step(), or put on per-request asyncio queues).

MPCoreClient spawns EngineCoreProc and talks to it over two ipc sockets in a private temporary directory
(mode 0700, unique per instance, see ipc_dirs.py); only msgspec-encoded protocol messages cross them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from pagedllm.config import EngineArgs, LoRAConfig, RequestLimits
from pagedllm.config.embedder import EmbedderConfig
from pagedllm.core.kv_cache_interface import plugged_factory
from pagedllm.core.request import RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.ipc_dirs import make_ipc_dir, remove_ipc_dir, remove_stale_ipc_dirs, set_owners
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.protocol import (
    AbortRequestsMsg,
    AddRequestMsg,
    CoreMessage,
    EngineCoreRequest,
    EngineDeadMsg,
    ReadyMsg,
    ShutdownMsg,
    UtilityRequestMsg,
)
from pagedllm.errors import EngineDeadError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class CoreInput(Protocol):
    """What the front end sends to an engine core (EngineCore and MPCoreClient both fit)."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None: ...


class FrontendCore:
    """One admission path and one output path, whatever delivers the results."""

    def __init__(self, core: CoreInput, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: Sequence[int], limits: RequestLimits | None = None,
                 scheduling_policy: str = "fcfs", lora_config: LoRAConfig | None = None,
                 embedder: EmbedderConfig | None = None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, vocab_size, max_model_len, eos_token_ids, limits,
                                              scheduling_policy, lora_config, embedder)
        self.output_processor = OutputProcessor(tokenizer)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    cache_salt: str | None = None, stream: bool = False, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """Validate, tokenize, register and send a request to the core; returns what was sent.

        Raises InvalidRequestError (nothing registered, nothing sent) if the request is malformed
        or its id is taken. If the core refuses it at once (in-process: it can never fit the KV
        cache), the request is unregistered and the error propagates.
        """
        text, request = self.input_processor.process(request_id, prompt, params, cache_salt, priority, lora_request)
        self.submit(request, text, stream)
        return request

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                            cache_salt: str | None = None, priority: int = 0,
                            prompt_name: str | None = None, text_pair: str | None = None) -> EngineCoreRequest:
        """As add_request, for an embedding (or with `text_pair`, a cross-encoder's score of the pair): the
        request ends with one PoolingRequestOutput."""
        text, request = self.input_processor.process_pooling(request_id, prompt, params, cache_salt, priority,
                                                             prompt_name, text_pair)
        self.submit(request, text)
        return request

    def submit(self, request: EngineCoreRequest, text: str | None, stream: bool = False) -> None:
        """Register and send a request `input_processor.process` made (the asyncio server processes it
        on a worker thread, then submits it on the event loop); raises like add_request."""
        self.output_processor.add_request(request, text, stream)
        try:
            self.core.add_request(request)
        except BaseException:
            self.output_processor.abort_request(request.req_id)
            raise

    def abort_request(self, request_id: str) -> None:
        """Forget a request and abort its unfinished sequences in the core (no-op when unknown)."""
        seq_req_ids = self.output_processor.abort_request(request_id)
        if seq_req_ids:
            self.core.abort_requests(seq_req_ids)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Make the RequestOutputs of one core step; sequences ended by a stop string are stopped in the core."""
        request_outputs, to_stop = self.output_processor.process_outputs(outputs)
        if to_stop:
            self.core.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        return request_outputs

    def request_id_of(self, seq_req_id: str) -> str | None:
        """The user request a core request id belongs to (None when unknown or finished)."""
        return self.output_processor.request_id_of(seq_req_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()


_POLL_MS = 100
"""Slice of each wait for output; between slices the client checks that the core is alive."""


class MPCoreClient:
    """The core in a spawned process. Sends are immediate and non-blocking; receives are awaited.

    Construct it, then `await wait_ready()`; read outputs with `await get_output()`, which
    raises EngineDeadError once the core has died (a dead signal, or the process vanished).
    """

    def __init__(self, engine_args: EngineArgs, log_level: str = "INFO", tcp_host: str | None = None) -> None:
        """tcp_host: bind the two sockets on tcp://tcp_host:<free port> instead of ipc (a core on another
        machine can reach them: Ray replicas); the ipc directory is then not made."""
        self._ipc_dir: str | None = None
        if tcp_host is None:
            remove_stale_ipc_dirs()  # left by engines whose processes were killed
            self._ipc_dir = make_ipc_dir()
            input_address = f"ipc://{os.path.join(self._ipc_dir, 'input')}"
            output_address = f"ipc://{os.path.join(self._ipc_dir, 'output')}"
        else:
            input_address = output_address = f"tcp://{tcp_host}:*"
        self._ctx = zmq.Context()
        self._input_socket = self._ctx.socket(zmq.PUSH)  # sync: sends never wait (no HWM)
        self._input_socket.setsockopt(zmq.SNDHWM, 0)
        self._input_socket.setsockopt(zmq.LINGER, 0)
        self._input_socket.bind(input_address)
        self._output_socket = zmq.asyncio.Socket.from_socket(self._ctx.socket(zmq.PULL))
        self._output_socket.setsockopt(zmq.RCVHWM, 0)
        self._output_socket.setsockopt(zmq.LINGER, 0)
        self._output_socket.bind(output_address)
        self.input_address = self._input_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_address = self._output_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._call_ids = itertools.count()
        self.dead_error: EngineDeadError | None = None
        self._closed = False
        self._start_core(engine_args, log_level)

    def _start_core(self, engine_args: EngineArgs, log_level: str) -> None:
        """Start the core that connects to input_address/output_address (here: a spawned child, which inherits
        a KV cache manager plugged in here: core/kv_cache_interface.py)."""
        from pagedllm.engine.core_proc import run_engine_core

        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core, name="pagedllm-engine-core",
            args=(engine_args, self.input_address, self.output_address, log_level, plugged_factory()),
        )
        self.process.start()
        if self._ipc_dir is not None:
            set_owners(self._ipc_dir, [os.getpid(), self.process.pid])

    def is_alive(self) -> bool:
        """Whether the core (its process) is still there."""
        return self.process.is_alive()

    def _death_reason(self) -> str:
        return f"the engine core process exited unexpectedly (exit code {self.process.exitcode})"

    @property
    def ipc_dir(self) -> str:
        return self._ipc_dir

    # --- sending ------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request in the core; a refusal comes back as a RequestRejectedMsg."""
        self._send(AddRequestMsg(request))

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Ask the core to end these requests and free their blocks."""
        if req_ids:
            self._send(AbortRequestsMsg(list(req_ids), status))

    def request_utility(self, method: str) -> int:
        """Send a utility call; returns the call id its UtilityResultMsg will carry."""
        call_id = next(self._call_ids)
        self._send(UtilityRequestMsg(call_id, method))
        return call_id

    def _send(self, msg) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("the engine core client is shut down")
        self._input_socket.send(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)

    # --- receiving ----------------------------------------------------------------------

    async def get_output(self) -> CoreMessage:
        """The next message from the core. Raises EngineDeadError when the core is gone."""
        if self.dead_error is not None:
            raise self.dead_error
        while True:
            if await self._output_socket.poll(_POLL_MS, zmq.POLLIN):
                msg = self._decoder.decode(await self._output_socket.recv())
                if isinstance(msg, EngineDeadMsg):
                    self.dead_error = EngineDeadError(msg.error)
                    raise self.dead_error
                return msg
            if not self.is_alive():
                # a dead signal sent just before exiting may still be in flight
                if await self._output_socket.poll(_POLL_MS, zmq.POLLIN):
                    continue
                self.dead_error = EngineDeadError(self._death_reason())
                raise self.dead_error

    async def wait_ready(self, timeout_s: float = 900.0) -> ReadyMsg:
        """Wait for the core to load its model. Raises EngineDeadError if it fails or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = await asyncio.wait_for(self.get_output(), timeout=max(deadline - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                break
            if isinstance(msg, ReadyMsg):
                return msg
            logger.warning("ignoring %s before the engine core was ready", type(msg).__name__)
        self.shutdown()
        raise EngineDeadError(f"the engine core was not ready within {timeout_s:.0f} s")

    # --- shutdown -----------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to exit, wait for it, then kill it if needed; remove the ipc dir (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop_core(timeout_s)
        self._input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._ctx.term()
        if self._ipc_dir is not None:
            remove_ipc_dir(self._ipc_dir)

    def _stop_core(self, timeout_s: float) -> None:
        if self.process.is_alive():
            try:
                self._input_socket.send(self._encoder.encode(ShutdownMsg()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("engine core did not exit in %.0f s; terminating it", timeout_s)
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
