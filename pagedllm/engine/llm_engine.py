"""LLMEngine: the synchronous front end over an in-process EngineCore.

add_request() tokenizes and validates; step() runs one core iteration and returns text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagedllm.config import EngineArgs
from pagedllm.core.request import RequestStatus
from pagedllm.engine.core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.protocol import EngineStatsMsg
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.interface import eos_token_ids_of

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, engine_args: EngineArgs | None = None, core: EngineCore | None = None,
                 kv_cache_manager_factory=None) -> None:
        self.engine_args = engine_args or EngineArgs()
        self.core = core if core is not None else EngineCore(self.engine_args,
                                                             kv_cache_manager_factory=kv_cache_manager_factory)
        loaded = self.core.loaded
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.max_model_len = self.core.scheduler_config.max_model_len
        self.input_processor = InputProcessor(
            self.tokenizer, self.hf_config.vocab_size, self.max_model_len,
            eos_token_ids_of(self.hf_config, self.tokenizer),
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    cache_salt: str | None = None, stream: bool = False) -> None:
        """Queue a request. Raises InvalidRequestError (nothing queued) if it is malformed or cannot fit."""
        params = params if params is not None else SamplingParams()
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; pass {'prompt_token_ids': [...]}")
        text, core_request = self.input_processor.process(request_id, prompt, params, cache_salt)
        num_sequences = params.num_sequences
        seq_ids = [request_id] if num_sequences == 1 else [f"{request_id}#{i}" for i in range(num_sequences)]
        core_request.req_id = seq_ids[0]
        core_request.sequence_ids = seq_ids if num_sequences > 1 else None
        self.core.add_request(core_request)
        self.output_processor.add_request(request_id, text, core_request.prompt_token_ids, params, seq_ids, stream)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of the requests it touched."""
        core_outputs = self.core.step()
        request_outputs, to_stop = self.output_processor.process_outputs(core_outputs)
        if to_stop:
            self.core.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        return request_outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by id now; their blocks are free when this returns."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> EngineStatsMsg:
        """The core's gauges and cumulative counters (EngineCore.stats)."""
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False if some are still in use."""
        return self.core.reset_prefix_cache()
