"""LoRA adapters over HTTP: the served adapter names (``--lora-modules name=path`` or vLLM's JSON form), and, with
``--allow-runtime-lora-updating``, vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(under /v1/, so behind the API key when keys are set).

An adapter is checked (its config read) when it is registered; its weights are read by each engine replica
the first time a request names it, so with ``-dp N`` every replica serves it, and a restarted replica reads
it again. Unloading removes the name: new requests naming it get 404; requests already running finish with
the adapter they started with.
"""

from __future__ import annotations

import itertools

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.lora.request import LoRAError, LoRARequest


class LoRARegistry:
    """The adapters this server serves, by name; each gets an id of its own (never reused)."""

    def __init__(self, check) -> None:
        self._check = check  # AsyncLLM.check_lora: LoRAError naming why an adapter cannot be served
        self._ids = itertools.count(1)
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        """The served base-model name each adapter reports as its parent (--lora-modules' base_model_name)."""

    def add(self, name: str, path: str, base_names: list[str], parent: str | None = None) -> LoRARequest:
        """Register an adapter; LoRAError if the name is taken, `parent` is no served name, or the adapter cannot
        be served."""
        if name in self.adapters or name in base_names:
            raise LoRAError(f"the name {name!r} is already in use; unload it first or choose another")
        if parent is not None and parent not in base_names:
            raise LoRAError(f"the adapter {name!r} names base_model_name {parent!r}, which this server does not "
                            f"serve (it serves {', '.join(map(repr, base_names))})")
        request = LoRARequest(name, next(self._ids), path)
        self._check(request)
        self.adapters[name] = request
        self.parents[name] = parent or base_names[0]
        return request

    def remove(self, name: str) -> LoRARequest:
        request = self.adapters.pop(name, None)
        self.parents.pop(name, None)
        if request is None:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name", code="model_not_found")
        return request


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, registry: LoRARegistry, base_names: list[str], read_body) -> None:
    """The runtime load/unload routes (call only when runtime updating is allowed)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request):
        body = await read_body(raw_request, LoadLoRAAdapterRequest)
        try:
            registry.add(body.lora_name, body.lora_path, base_names)
        except LoRAError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request):
        body = await read_body(raw_request, UnloadLoRAAdapterRequest)
        registry.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
