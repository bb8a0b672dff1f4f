"""What a request says about its adapter (torch-free: core/ and the front end read it)."""

from __future__ import annotations

import msgspec

from pagedllm.errors import InvalidRequestError


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served: missing path, not a PEFT LoRA adapter, rank above max_lora_rank,
    target modules the model does not have, or LoRA not enabled (maps to HTTP 400)."""


class LoRARequest(msgspec.Struct, frozen=True):
    """A PEFT LoRA adapter to generate with: `lora_name` names it, `lora_int_id` (>= 1) identifies it in the
    engine, `lora_path` is its directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def cache_key(self) -> str:
        """The prefix-cache extra key: blocks computed under one adapter are never served to another or the base."""
        return f"lora:{self.lora_int_id}:{self.lora_path}"
