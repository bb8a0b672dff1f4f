"""What the engine core needs of a worker: the executor contract and the plain records it returns.

No torch here (the engine core imports this module, and only this one, from worker/). The
executor loads the model, sizes the KV cache and runs steps; the core gets back the numbers it
schedules with (KVCacheInfo) and the front ends the tokenizer and config (ModelInfo).

    EngineCore ──create──> Executor ── .model_info ──────────────────> ModelInfo
                              └─────── .initialize_kv_cache(cache, sched) ──> KVCacheInfo
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput


def eos_token_ids_of(hf_config, tokenizer) -> list[int]:
    """The model's end-of-sequence ids: the config's (one or several), else the tokenizer's."""
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The loaded model as the core and the front ends see it: no weights."""

    model_path: str
    """The Hugging Face directory actually loaded."""
    hf_config: object
    """Its transformers config."""
    vocab_size: int
    max_position_embeddings: int
    """The model's context length (4096 when the config does not say)."""
    eos_token_ids: tuple[int, ...]
    device_type: str = "cpu"
    """Where the weights run, 'cpu' or 'cuda' (some defaults depend on it: the step's token budget)."""
    load_tokenizer: Callable[[], object | None] = lambda: None
    """The transformers tokenizer (None when the directory has none), read at the first call: an engine core
    serving a front end in another process needs it only for structured outputs."""

    @property
    def tokenizer(self) -> object | None:
        return self.load_tokenizer()

    @property
    def chat_template(self) -> str | None:
        tokenizer = self.load_tokenizer()
        return getattr(tokenizer, "chat_template", None) if tokenizer is not None else None

    @classmethod
    def from_loaded(cls, loaded, device_type: str = "cpu") -> ModelInfo:
        """From a model.loader.LoadedModel (whose weights, if any, stay with the executor)."""
        config = loaded.hf_config
        # The tokenizer's end-of-sequence id only when the config names none: reading it is what loads it.
        eos = eos_token_ids_of(config, None) or eos_token_ids_of(config, loaded.tokenizer)
        return cls(
            model_path=loaded.model_path, hf_config=config, vocab_size=config.vocab_size,
            # an encoder may reserve positions (RoBERTa numbers its tokens from padding_idx + 1)
            max_position_embeddings=getattr(loaded.model, "max_sequence_length", None)
            or getattr(config, "max_position_embeddings", 4096),
            eos_token_ids=tuple(eos), device_type=device_type, load_tokenizer=lambda: loaded.tokenizer,
        )


@dataclass(frozen=True, slots=True)
class KVCacheInfo:
    """The KV cache the executor allocated (per rank, with tensor parallelism)."""

    num_blocks: int
    """Device blocks: what the KV cache manager hands out."""
    num_host_blocks: int
    """Host blocks for swapped-out requests (0 unless preemption_mode='swap')."""
    block_size: int
    """Tokens per block."""
    bytes_per_block: int
    """K and V of every layer for one block, on one rank."""
    num_kv_heads: int
    """KV heads each rank caches."""
    sliding_window: int | None = None
    """The attention window every layer (and a draft model's) shares; None if any reads the whole context
    (or the executor does not say): the KV cache manager then frees nothing behind it."""


class Executor(ABC):
    """Runs the model for the engine core: in this process, or as N tensor-parallel ranks."""

    model_info: ModelInfo
    """Set by the constructor, which loads the model (or, with tensor parallelism, its config)."""
    failure: str | None = None
    """Why a worker failed, once one has (the engine must not schedule again); None while all run. The engine
    core reads it before every step, idle ones too, so a dead tensor-parallel group is found without a request."""

    @abstractmethod
    def initialize_kv_cache(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> KVCacheInfo:
        """Size and allocate the KV cache (profiling the GPU where needed); ready to step afterwards."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every shard; the sampled tokens (identical on every rank)."""

    def shutdown(self) -> None:
        """Stop the workers and release the sockets (idempotent)."""
