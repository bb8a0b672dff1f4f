"""Settings, each declared once: the frozen runtime configs (`runtime.py`), the flat `EngineArgs` a user
sets (`engine_args.py`, whose fields copy the configs' defaults), and the flags generated from both
(`flags.py`). Environment variables live in `pagedllm.envs`."""

from pagedllm.config.engine_args import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, EngineArgs, setting
from pagedllm.config.flags import add_flags, check_choices, field_docs, flag, parse_memory_size, parse_token_count
from pagedllm.config.runtime import (
    DEFAULT_MAX_MODEL_LEN_CAP,
    DISTRIBUTED_SECRET_ENV,
    EXECUTOR_BACKENDS,
    MIN_SECRET_CHARS,
    PREEMPTION_MODES,
    ROUTINGS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    CacheConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RequestLimits,
    SchedulerConfig,
    SpeculativeConfig,
    parse_speculative_config,
)

__all__ = [
    "ATTENTION_BACKENDS", "DEFAULT_MAX_MODEL_LEN_CAP", "DISTRIBUTED_SECRET_ENV", "DTYPES", "EXECUTOR_BACKENDS",
    "KV_CACHE_DTYPES", "MIN_SECRET_CHARS", "PREEMPTION_MODES", "ROUTINGS", "SCHEDULING_POLICIES",
    "SPECULATIVE_METHODS", "CacheConfig", "DeviceConfig", "EngineArgs", "LoRAConfig", "ModelConfig", "ParallelConfig",
    "RequestLimits", "SchedulerConfig", "SpeculativeConfig", "add_flags", "check_choices", "field_docs", "flag",
    "parse_memory_size", "parse_speculative_config", "parse_token_count", "setting",
]
