"""LLMEngine: the synchronous front end over an in-process EngineCore.

add_request() tokenizes, validates and queues (FrontendCore); step() runs one core iteration
and returns RequestOutputs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagedllm.config import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_client import FrontendCore
from pagedllm.engine.generation_defaults import log_generation_defaults, resolve_generation_defaults
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.protocol import EngineStatsMsg
from pagedllm.lora.request import LoRARequest
from pagedllm.config.embedder import embedder_for
from pagedllm.pooling_params import PoolingParams
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.interface import eos_token_ids_of

logger = logging.getLogger(__name__)


class LLMEngine:
    """The synchronous front end: FrontendCore over an EngineCore in this process."""

    def __init__(self, engine_args: EngineArgs | None = None, core: EngineCore | None = None) -> None:
        self.engine_args = engine_args or EngineArgs()
        self.core = core if core is not None else EngineCore(self.engine_args)
        loaded = self.core.loaded
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.max_model_len = self.core.scheduler_config.max_model_len
        self.frontend = FrontendCore(self.core, self.tokenizer, self.hf_config.vocab_size, self.max_model_len,
                                     eos_token_ids_of(self.hf_config, self.tokenizer),
                                     limits=self.engine_args.request_limits(),
                                     scheduling_policy=self.engine_args.scheduling_policy,
                                     lora_config=self.engine_args.lora_config(),
                                     embedder=embedder_for(self.engine_args.runner, loaded.model_path,
                                                           self.engine_args.model))
        self.generation_defaults, source = resolve_generation_defaults(
            self.engine_args.generation_config, self.engine_args.model, loaded.model_path)
        """The model's sampling defaults (generation_defaults.py): what a request given no params runs with."""
        if self.engine_args.runner != "pooling":  # a pooling engine samples nothing
            log_generation_defaults(self.generation_defaults, source)

    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the model's generation-config sampling fields over
        SamplingParams' own defaults."""
        return SamplingParams(**self.generation_defaults)

    @property
    def input_processor(self) -> InputProcessor:
        return self.frontend.input_processor

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    cache_salt: str | None = None, stream: bool = False, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (nothing queued) if it is malformed or cannot fit.

        `priority`: lower runs sooner (scheduling_policy='priority' only; must be 0 otherwise)."""
        self.frontend.add_request(request_id, prompt, params if params is not None else self.default_sampling_params(),
                                  cache_salt, stream, priority, lora_request)

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams | None = None,
                            priority: int = 0, prompt_name: str | None = None, text_pair: str | None = None) -> None:
        """Queue an embedding request (runner 'pooling' or 'both'); raises InvalidRequestError (nothing queued)
        if it is malformed. `prompt_name`: one of the model's sentence-transformers prompts (default: its
        default_prompt_name) put before a text input. `text_pair`: score (`prompt`, `text_pair`) with a
        cross-encoder."""
        self.frontend.add_pooling_request(request_id, prompt, params if params is not None else PoolingParams(),
                                          priority=priority, prompt_name=prompt_name, text_pair=text_pair)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of the requests it touched."""
        return self.frontend.process_outputs(self.core.step())

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by id now; their blocks are free when this returns."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.frontend.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.frontend.has_unfinished_requests() or self.core.has_unfinished_requests()

    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> EngineStatsMsg:
        """The core's gauges and cumulative counters (EngineCore.stats)."""
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False if some are still in use."""
        return self.core.reset_prefix_cache()
