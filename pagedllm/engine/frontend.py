"""The front-end core shared by LLMEngine (offline) and AsyncLLM (asyncio server).

    add_request:  prompt ─ InputProcessor ─> EngineCoreRequest ─ OutputProcessor (register) ─> core
    outputs:      core outputs ─ OutputProcessor (text, stop strings, n) ─> RequestOutputs
                                 └─ stop strings found here ─> core.abort_requests(FINISHED_STOPPED)

The two front ends differ only in what `core` is (an in-process EngineCore, or the ZMQ client
of a core process) and in how they deliver RequestOutputs (returned from step(), or put on
per-request asyncio queues).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedllm.config import LoRAConfig, RequestLimits
from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.config.embedder import EmbedderConfig
from pagedllm.pooling_params import PoolingParams
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


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
