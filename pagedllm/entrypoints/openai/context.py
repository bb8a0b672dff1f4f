"""What the endpoint handlers share: the engine and the server's settings, and the fields every
response carries (ids, timestamps, usage)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import Request

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.auth import request_api_key, tenant_cache_salt
from pagedllm.entrypoints.openai.cli_args import ServerConfig
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving_lora import LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import ServerMetrics


@dataclass
class ServingContext:
    """The engine and the server's settings, as every handler sees them."""

    engine: AsyncLLM
    served_model_names: list[str]
    config: ServerConfig
    metrics: ServerMetrics | None = None
    loras: LoRARegistry | None = None
    """The LoRA adapters a request's model may name (serving_lora.py); None when LoRA is off."""

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def report_cached_tokens(self) -> bool:
        """Whether usage may say how many prompt tokens were cached: only when no tenant can learn
        from it what another sent (keys that do not share the cache), or when the operator opts in."""
        c = self.config
        return c.enable_prompt_tokens_details or (bool(c.api_keys) and not c.share_prefix_cache_across_keys)

    def check_model(self, requested: str | None) -> str:
        """The model name to answer with (the first served name for any of them, as vLLM); 404 for a model this
        server does not serve."""
        if requested is None or requested in self.served_model_names:
            return self.model_name
        if self.loras is not None and requested in self.loras.adapters:
            return requested
        served = [*self.served_model_names, *(self.loras.adapters if self.loras is not None else ())]
        raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                            f"{', '.join(map(repr, served))}", param="model", code="model_not_found")

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a (checked) model name stands for; None for the base model."""
        return self.loras.adapters.get(model) if self.loras is not None else None

    def cache_salt(self, raw_request: Request, request_salt: str | None) -> str | None:
        """The prefix-cache salt: the request's own, joined with its tenant's when the server has keys."""
        if not self.config.api_keys:
            return request_salt
        return tenant_cache_salt(request_api_key(raw_request), request_salt, self.config.share_prefix_cache_across_keys)

    def usage(self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
        usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                 "total_tokens": num_prompt_tokens + num_completion_tokens}
        if self.report_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
        return usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
