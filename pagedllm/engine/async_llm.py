"""AsyncLLM: the asyncio front end of a server, with the engine core in its own process.

    add_request() ── FrontendCore (InputProcessor) ──> MPCoreClient ──ZMQ──> EngineCoreProc
        │ returns                                                              │
    RequestStream <── put() ── FrontendCore (OutputProcessor) <── output handler task
        └── close() / fail() ── release ──> AsyncLLM: unregister; abort in the core unless finished

Tokenization and validation happen here, on a worker thread so that a huge prompt never stalls
the event loop (InvalidRequestError before anything is queued);
admission, text, stop strings, n > 1 and logprobs are the same FrontendCore the offline
engine uses. Closing a generate() stream early aborts its request in the core. When the
core dies, every waiting stream and every later call raises EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedllm.config import EngineArgs, LoRAConfig, RequestLimits
from pagedllm.config.embedder import EmbedderConfig, embedder_for
from pagedllm.engine.core_client import FrontendCore, MPCoreClient
from pagedllm.engine.dp_client import ReplicaLostMsg
from pagedllm.engine.frontend_files import load_tokenizer, prepare_model_files_in_child
from pagedllm.engine.generation_defaults import log_generation_defaults, resolve_generation_defaults
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.protocol import EngineStatsMsg, OutputsMsg, ReadyMsg, RequestRejectedMsg
from pagedllm.errors import EngineDeadError, InvalidRequestError
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import ServerMetrics
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """The engine could not serve one request (an internal error); others are unaffected."""


class RequestTimeoutError(RequestFailedError):
    """The request ran past its deadline and was aborted (its KV blocks are freed)."""


class EngineStoppingError(RequestFailedError):
    """The server is shutting down and ended this request before it finished."""


class RequestStream:
    """The outputs of one request, in order; iterate it, then close() it (idempotent).

    Two sides, one owner. AsyncLLM owns the registry of open streams and feeds each one (`put`,
    `put_error`); it never touches a stream's queue. The reader iterates and ends the stream with
    `close()` or `fail(error)`; either tells the owner once, through `release` (which unregisters it
    and aborts the request in the core unless it finished). A sequence that failed alone (a RequestOutput's
    completion carries an `error`) fails the whole request: iterating raises RequestFailedError naming it.
    """

    def __init__(self, request_id: str, release: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self._release = release
        self._queue: asyncio.Queue = asyncio.Queue()
        self.started = False
        """An output or an error arrived: the request no longer waits (num_waiting_requests)."""
        self.finished = False
        """The reader got the request's last output."""
        self.error: BaseException | None = None
        """What fail() ended it with; iterating raises it."""
        self._closed = False

    # --- the owner's side ---------------------------------------------------------------

    def put(self, output: RequestOutput) -> None:
        self.started = True
        self._queue.put_nowait(output)

    def put_error(self, error: BaseException) -> None:
        """Iterating raises `error` after the outputs already put."""
        self.started = True
        self._queue.put_nowait(error)

    # --- the reader's side --------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if isinstance(item, RequestOutput):  # a pooling request's failure is its endpoint's to report
            failed = next((c.error for c in item.outputs if c.error is not None), None)
            if failed is not None:
                self.close()
                raise RequestFailedError(f"request {self.request_id} failed: {failed}")
        if item.finished:
            self.finished = True
            self.close()
        return item

    def fail(self, error: BaseException) -> bool:
        """Abort the request unless it finished, failed or was closed; iterating raises `error`.
        True if it was open."""
        if self.finished or self._closed or self.error is not None:
            return False
        self.error = error
        self.put_error(error)
        self._release(self)
        return True

    def close(self) -> None:
        """Stop listening; abort the request in the core if it has not finished."""
        if self._closed:
            return
        self._closed = True
        if self.error is None:  # fail() released it already
            self._release(self)


class AsyncLLM:
    """Serve many concurrent requests from one event loop. Build it with `await AsyncLLM.start(args)`."""

    def __init__(self, client: MPCoreClient, ready: ReadyMsg, tokenizer, metrics: ServerMetrics | None = None,
                 num_threads: int = 4, limits: RequestLimits | None = None, scheduling_policy: str = "fcfs",
                 lora_config: LoRAConfig | None = None, embedder: EmbedderConfig | None = None,
                 generation_defaults: dict[str, float | int] | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_path = ready.model_path
        self.generation_defaults = generation_defaults or {}
        """The model's sampling defaults (generation_defaults.py): what a request that leaves them out gets."""
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = ready.num_blocks
        self.frontend = FrontendCore(client, tokenizer, ready.vocab_size, ready.max_model_len, ready.eos_token_ids,
                                     limits, scheduling_policy, lora_config, embedder)
        self.embedder = embedder
        """The model's pooling (runner 'pooling': embeddings only); None when it generates."""
        self.metrics = metrics
        self.latest_stats: EngineStatsMsg | None = None
        self.dead_error: EngineDeadError | None = None
        self._streams: dict[str, RequestStream] = {}
        """The open streams by request id: registered by add_request, forgotten when their reader ends them."""
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        """Called once, on the event loop, when the core dies (the server decides whether to exit)."""
        self.executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="pagedllm-frontend")
        """Where CPU-heavy front-end work runs: tokenization, chat templates, big responses."""
        self._output_task = asyncio.get_running_loop().create_task(self._run_output_handler())

    @classmethod
    async def start(cls, engine_args: EngineArgs, metrics: ServerMetrics | None = None,
                    log_level: str = "INFO", ready_timeout_s: float = 900.0,
                    num_threads: int = 4) -> AsyncLLM:
        """Spawn the engine core (or data-parallel replicas: DPCoreClient), and load the tokenizer here while its
        model loads."""
        # A GGUF's first conversion, and its config resolved with transformers, happen before the core starts, so
        # that it loads without transformers' config classes; in a child, so that this process never imports torch.
        model_dir = await asyncio.to_thread(prepare_model_files_in_child, engine_args, log_level)
        if engine_args.parallel_config().uses_dp_client:
            from pagedllm.engine.dp_client import DPCoreClient

            client = DPCoreClient(engine_args, log_level, metrics)
        else:
            client = MPCoreClient(engine_args, log_level)
        tokenizer_loaded = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, str(model_dir)))
        try:
            ready = await client.wait_ready(ready_timeout_s)
            tokenizer = await tokenizer_loaded
            generation_defaults, source = resolve_generation_defaults(engine_args.generation_config,
                                                                      engine_args.model, ready.model_path)
        except BaseException:
            tokenizer_loaded.cancel()
            client.shutdown()
            raise
        if engine_args.runner != "pooling":  # a pooling engine samples nothing
            log_generation_defaults(generation_defaults, source)
        return cls(client, ready, tokenizer, metrics, num_threads, engine_args.request_limits(),
                   engine_args.scheduling_policy, engine_args.lora_config(),
                   embedder_for(engine_args.runner, ready.model_path, engine_args.model), generation_defaults)

    # --- requests ----------------------------------------------------------------------

    async def run_blocking(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the front-end thread pool, so the event loop keeps serving meanwhile."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)  # keeps e.g. the request id
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                          cache_salt: str | None = None, stream: bool = True, priority: int = 0,
                          lora_request: LoRARequest | None = None, num_prompts: int = 1) -> RequestStream:
        """Validate, tokenize (off the event loop) and queue a request; iterate the returned stream.

        Raises InvalidRequestError (nothing queued) for a request that can never be served, and
        EngineDeadError when the core is gone. A refusal by the core (the request can never fit
        its KV cache) arrives on the stream. Cancelled while tokenizing, nothing is queued.
        `priority`: lower runs sooner (scheduling_policy='priority' only; must be 0 otherwise).
        With PoolingParams it is an embedding request (runner 'pooling'), ending with one PoolingRequestOutput;
        a (text, text_pair) tuple as its prompt is a cross-encoder's pair to score. `num_prompts`: the prompts of
        the client's request this is one of (the limit on sequences counts max(n, best_of) for each).
        """
        self._check_alive()
        if request_id in self._streams:  # an earlier stream under this id is still open
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request_stream = RequestStream(request_id, self._release)
        self._streams[request_id] = request_stream  # holds the id (and counts as waiting) while tokenizing
        try:
            if isinstance(params, PoolingParams):
                prompt, text_pair = prompt if isinstance(prompt, tuple) else (prompt, None)
                text, request = await self.run_blocking(self.frontend.input_processor.process_pooling, request_id,
                                                        prompt, params, cache_salt, priority, None, text_pair)
            else:
                text, request = await self.run_blocking(self.frontend.input_processor.process, request_id, prompt,
                                                        params, cache_salt, priority, lora_request, num_prompts)
            self._check_alive()
            if request_stream.error is not None:  # aborted (e.g. by a shutdown) while tokenizing
                raise request_stream.error
            self.frontend.submit(request, text, stream)
        except BaseException:
            self._forget(request_stream)
            raise
        if self.metrics is not None:
            self.metrics.record_request_added(request_id, len(request.prompt_token_ids), request.arrival_time,
                                              request.priority, lora_request.lora_name if lora_request else None)
            if request.sampling_params.structured_outputs is not None:
                self.metrics.record_grammar_stats(self.frontend.input_processor.grammar_stats())
        return request_stream

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Refuse an adapter this engine cannot serve (LoRAError naming why), before a request names it."""
        self.frontend.input_processor.check_lora(lora_request)

    def check_token_ids(self, token_ids: list[int], what: str) -> None:
        """Refuse ids outside the vocabulary (InvalidRequestError naming `what`)."""
        self.frontend.input_processor.check_token_ids(token_ids, what)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       cache_salt: str | None = None, stream: bool = True,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs until the request finishes (deltas when `stream`, else cumulative).

        Raises like add_request, and RequestFailedError when this request failed alone. Closing
        the generator before it finishes aborts the request in the core.
        """
        request_stream = await self.add_request(request_id, prompt, params, cache_salt, stream, priority)
        try:
            async for output in request_stream:
                yield output
        finally:
            request_stream.close()

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request by id now (no-op when unknown or finished); its stream raises `error`
        (default: RequestFailedError)."""
        request_stream = self._streams.get(request_id)
        if request_stream is None:
            self._abort_in_core(request_id)
        else:  # the stream calls _release: unregistered and aborted in the core
            request_stream.fail(error if error is not None else RequestFailedError(f"request {request_id} was aborted"))

    def abort_all(self, error: BaseException) -> int:
        """Abort every open request, each stream raising `error` (a draining server's last word)."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id, error)
        return len(request_ids)

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    @property
    def num_waiting_requests(self) -> int:
        """Requests accepted here that have not produced an output (or failed) yet: tokenizing, or queued
        in the core."""
        return sum(not s.started for s in self._streams.values())

    def _release(self, request_stream: RequestStream) -> None:
        """A stream's reader ended it (close or fail): forget it, and abort its request unless it finished."""
        self._forget(request_stream)
        if not request_stream.finished:
            self._abort_in_core(request_stream.request_id)

    def _forget(self, request_stream: RequestStream) -> None:
        if self._streams.get(request_stream.request_id) is request_stream:
            del self._streams[request_stream.request_id]

    def _abort_in_core(self, request_id: str) -> None:
        if self.metrics is not None:
            self.metrics.record_request_finished(request_id, "abort")
        try:
            self.frontend.abort_request(request_id)
        except EngineDeadError:
            pass  # nothing left to free

    # --- health and utilities -------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def check_health(self) -> None:
        """Raise EngineDeadError unless the core is alive."""
        self._check_alive()
        if not self.client.is_alive():
            self._set_dead(EngineDeadError("the engine core process is not running"))
            raise EngineDeadError("the engine core process is not running")

    async def shutdown(self) -> None:
        """Stop the output handler and the core process (idempotent)."""
        self.on_dead = None  # the core stopping now is no death
        self._output_task.cancel()
        try:
            await self._output_task
        except (asyncio.CancelledError, Exception):
            pass
        await asyncio.to_thread(self.client.shutdown)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # --- the output handler ---------------------------------------------------------------

    async def _run_output_handler(self) -> None:
        try:
            while True:
                msg = await self.client.get_output()
                if isinstance(msg, OutputsMsg):
                    self._handle_outputs(msg)
                elif isinstance(msg, RequestRejectedMsg):
                    self._handle_rejected(msg)
                elif isinstance(msg, ReplicaLostMsg):  # data parallel: this request's replica died
                    if (request_stream := self._streams.get(msg.req_id)) is not None:
                        request_stream.put_error(msg.error)
        except EngineDeadError as e:
            self._set_dead(e)
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("the output handler failed")
            self._set_dead(EngineDeadError(f"the output handler failed: {type(e).__name__}: {e}"))

    def _handle_outputs(self, msg: OutputsMsg) -> None:
        if msg.stats is not None:
            self.latest_stats = msg.stats
            if self.metrics is not None:
                self.metrics.record_engine_stats(msg.stats)
        if not msg.outputs:
            return
        now = time.monotonic()
        if self.metrics is not None:
            new_tokens: dict[str, int] = {}
            for out in msg.outputs:
                request_id = self.frontend.request_id_of(out.req_id)
                if request_id is not None and out.new_token_ids:
                    new_tokens[request_id] = new_tokens.get(request_id, 0) + len(out.new_token_ids)
                if request_id is not None and out.queue_time is not None:
                    self.metrics.record_queue_time(request_id, out.queue_time)
            for request_id, num_tokens in new_tokens.items():
                self.metrics.record_new_tokens(request_id, num_tokens, now)
        for output in self.frontend.process_outputs(msg.outputs):
            if output.finished and self.metrics is not None:
                reasons = ([c.finish_reason for c in output.outputs if c.finish_reason]
                           if isinstance(output, RequestOutput) else ["stop" if output.data is not None else "abort"])
                self.metrics.record_request_finished(output.request_id, reasons[0] if reasons else None, now)
            if (request_stream := self._streams.get(output.request_id)) is not None:
                request_stream.put(output)

    def _handle_rejected(self, msg: RequestRejectedMsg) -> None:
        # the front end's request id (one message for all n sequences)
        if (request_stream := self._streams.get(msg.req_id)) is not None:
            error_cls = InvalidRequestError if msg.invalid_request else RequestFailedError
            request_stream.put_error(error_cls(msg.message))

    def _set_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        logger.error("engine core is dead: %s", error)
        self.dead_error = error
        if self.metrics is not None:
            self.metrics.record_engine_dead()
        for request_stream in self._streams.values():
            request_stream.put_error(error)
        if self.on_dead is not None:
            self.on_dead(error)
