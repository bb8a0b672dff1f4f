"""The frozen runtime configs, each validated once, in its own `__post_init__`.

Every field here that a user sets is also an `EngineArgs` field and a flag of the `pagedllm` command:
its default, its choices and its docstring (the flag's help) are declared here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pagedllm.config.flags import check_choices, flag, parse_memory_size, parse_token_count
from pagedllm.request_limits import RequestLimits  # noqa: F401 (a config like the others; declared below them)

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("ngram", "draft_model")
EXECUTOR_BACKENDS = ("mp", "ray")
ROUTINGS = ("least-loaded", "prefix-affinity")
DEFAULT_MAX_MODEL_LEN_CAP = 4096
"""max_model_len when none is given: the model's context length, capped at this."""


def default_step_tokens(device_type: str, runner: str) -> int:
    """max_num_batched_tokens when none is given. 512 for generation on the CPU: a long step's activations set the
    engine's peak memory, and steps of 512 prefilled a long prompt as fast as steps of 2048 there (docs/benchmarks.md).
    2048 on CUDA and for pooling models (an encoder's batch of short texts ran faster in longer steps)."""
    return 512 if device_type == "cpu" and runner != "pooling" else 2048


def parse_kv_cache_memory(value: str | int | None) -> int | None:
    """A memory size ('2GiB', a byte count), or 'auto' / None for the default rule (config/kv_budget.py)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_memory_size(value)


@dataclass(frozen=True)
class ModelConfig:
    """What the executor loads and how it keeps the weights: the `EngineArgs` fields of these names, frozen once
    the arguments are checked (their defaults, choices and help are declared there, as flags)."""

    model: str | None
    """A Hugging Face directory or a .gguf file; None = the embedded default model."""
    dtype: str
    """Weight and activation dtype, as given ('auto' is resolved against the device by the executor)."""
    gguf_dequantize: bool
    """Dequantize a GGUF's quantized weights at load."""
    quantization: str
    """How an unquantized checkpoint's weights are kept on the CPU."""
    quant_activations: str
    """int8: the quantized linears quantize their inputs too."""
    runner: str
    """What the model serves: generate (text) or pooling (embeddings, scores)."""


@dataclass(frozen=True)
class DeviceConfig:
    """Where and how the executor runs a step: the `EngineArgs` fields of these names, frozen once the arguments
    are checked (declared there, as flags)."""

    device: str
    """'auto', 'cpu', 'cuda' or 'cuda:N', as given."""
    attention_backend: str
    kv_cache_dtype: str
    batch_invariant: bool
    """Kernels with a fixed per-row sum order (model/batch_invariant.py)."""
    num_threads: int | None
    """CPU intra-op threads of the process that runs the model; None = torch's default."""
    enforce_eager: bool
    gpu_memory_utilization: float
    seed: int
    """The engine's shared random generator's seed."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = flag(None, parse=parse_kv_cache_memory)
    """Bytes for the KV cache of all layers, e.g. 2GiB (ignored when num_kv_blocks is set); default (auto): room for
    16 requests of 2048 tokens, at most 4x the model's weight files (at least 256MiB) and a quarter of the available
    memory, at least one max_model_len request (config/kv_budget.py)."""
    num_kv_blocks: int | None = None
    """An explicit KV block count, overriding kv_cache_memory."""
    enable_prefix_caching: bool = True
    """Reuse the cached KV of full blocks shared with earlier requests."""
    preemption_mode: str = flag("recompute", choices=PREEMPTION_MODES)
    """How a preempted request gets its KV back: recompute it, or swap it out to host memory."""
    swap_space: int = flag(1 << 30, parse=parse_memory_size)
    """Host memory for swapped-out KV blocks (with preemption_mode swap), e.g. 1GiB."""
    kv_disk_cache: str | None = None
    """A folder where cached KV blocks evicted from memory are kept and read back on a later prefix miss, also
    after a restart (off by default: it writes to disk on every eviction; docs/kv-disk-cache.md)."""
    kv_disk_cache_size: int = flag(16 << 30, parse=parse_memory_size)
    """The most bytes the KV disk cache keeps (least recently used blocks go first), e.g. 16GiB."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_disk_cache_size <= 0:
            raise ValueError(f"kv_disk_cache_size must be > 0 bytes, got {self.kv_disk_cache_size}")
        if self.kv_disk_cache is not None and not self.enable_prefix_caching:
            raise ValueError("kv_disk_cache keeps prefix-cache blocks: it needs prefix caching on")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step; longer prompts are prefilled in chunks. Default: 512 for generation on the CPU,
    2048 on CUDA and for pooling models."""
    max_model_len: int | None = flag(None, parse=parse_token_count)
    """Longest sequence (prompt + output) served, e.g. 8192, 32k (32000) or 32K (32768); default: the model's context
    length, capped at 4096."""
    scheduling_policy: str = flag("fcfs", choices=SCHEDULING_POLICIES)
    """Order of admission: fcfs (first come, first served) or priority (a request's priority, lower first, then
    arrival; a waiting request may preempt a running one it outranks when blocks run out)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def for_model(self, model_max_len: int, device_type: str = "cpu", runner: str = "generate") -> SchedulerConfig:
        """This config resolved for the loaded model (what the scheduler gets): max_model_len against the model's
        context length (the default is min(model, 4096); a longer one than the model's raises ValueError), and
        max_num_batched_tokens against where it runs and what it serves (default_step_tokens)."""
        config = self
        if config.max_num_batched_tokens is None:
            config = dataclasses.replace(config, max_num_batched_tokens=default_step_tokens(device_type, runner))
        if config.max_model_len is None:
            return dataclasses.replace(config, max_model_len=min(model_max_len, DEFAULT_MAX_MODEL_LEN_CAP))
        if config.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length ({model_max_len})")
        return config


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens, the model scores them all in one step
    and keeps the longest prefix it agrees with (losslessly), plus one token of its own."""

    method: str = "ngram"
    """'ngram': prompt lookup, the tokens that followed the sequence's latest n-gram earlier in its own tokens;
    'draft_model': the greedy guesses of a smaller model with the same vocabulary (`model`)."""
    num_speculative_tokens: int = 3
    """Most tokens proposed per request per step (k); a step yields 1..k+1 tokens."""
    prompt_lookup_min: int = 1
    """Shortest n-gram matched (ngram)."""
    prompt_lookup_max: int = 4
    """Longest n-gram matched (ngram); longer matches are tried first."""
    model: str | None = None
    """draft_model: a smaller Llama-family model with the target's tokenizer (an HF directory or .gguf),
    run greedily by the worker with its own paged KV cache; required for that method, refused otherwise."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError('speculative method "draft_model" needs "model": the draft model\'s path')
            if not os.path.exists(os.path.expanduser(self.model)):
                raise ValueError(f"the draft model path {self.model!r} does not exist")
        elif self.model is not None:
            raise ValueError(f'"model" is only read by the "draft_model" method, not {self.method!r}')
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """A config from a dict or its JSON text (the --speculative-config flag); None/empty = off.
        Unknown keys raise ValueError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = parse_speculative_config(value)
        if not value:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**value)


def parse_speculative_config(text: str) -> dict:
    """The JSON object of --speculative-config, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    SpeculativeConfig.from_value(value)  # refuse a bad config at parse time
    return value


DISTRIBUTED_SECRET_ENV = "PAGEDLLM_DISTRIBUTED_SECRET"
"""The environment variable holding the tensor-parallel shared secret (preferred to the flag: argv is public)."""
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (tensor parallelism) and how they find each other."""

    tensor_parallel_size: int = 1
    """Worker processes, one model shard each (1: the model runs in the engine's process). With N > 1,
    kv_cache_memory is each rank's budget for its share of the KV heads."""
    master_addr: str = "127.0.0.1"
    """Address of the torch.distributed rendezvous (this host, reachable by every worker)."""
    master_port: int | None = None
    """Port of the rendezvous; default: a free one (set it when workers run on other hosts)."""
    num_local_workers: int | None = None
    """Ranks 0..k-1 are started here; the others join with `pagedllm worker`. Default: all of them."""
    distributed_timeout: float = 120.0
    """Seconds a collective, worker start-up or step may wait for a peer before the engine dies."""
    distributed_secret: str | None = flag(None, secret=True)
    """Shared secret every worker must prove it knows before it joins (at least 16 characters); required with
    workers on other hosts (default with only local workers: a random one per engine). Prefer the
    PAGEDLLM_DISTRIBUTED_SECRET environment variable: command lines are visible to other users."""
    data_parallel_size: int = 1
    """Engine replicas behind this one server, each with its own KV cache (and its own tensor-parallel ranks);
    requests are routed by --routing."""
    distributed_executor_backend: str = flag("mp", choices=EXECUTOR_BACKENDS)
    """mp: replicas are local processes (a dead one stays down); ray: Ray actors on the nodes of a Ray
    cluster, restarted when they die."""
    ray_address: str | None = None
    """Join this Ray cluster (implies --distributed-executor-backend ray); default: RAY_ADDRESS, else a local
    Ray instance."""
    ray_max_restarts: int = 3
    """How often Ray restarts one replica before it stays down."""
    routing: str = flag("least-loaded", choices=ROUTINGS)
    """least-loaded (fewest in-flight sequences) or prefix-affinity (the replica that last served the prompt's
    leading blocks, bounded by load)."""
    routing_affinity_blocks: int = 4
    """Leading full blocks of a prompt that prefix-affinity routing hashes."""
    routing_max_imbalance: int = 8
    """Prefix affinity yields to least-loaded when the affine replica has more in-flight sequences than the
    least-loaded one by more than this."""

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.num_local_workers is not None and not 0 <= self.num_local_workers <= tp:
            raise ValueError(f"num_local_workers must be in [0, {tp}], got {self.num_local_workers}")
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.distributed_secret is not None and len(self.distributed_secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the distributed secret must have at least {MIN_SECRET_CHARS} characters")
        if self.num_local < tp and self.distributed_secret is None:
            raise ValueError(
                f"ranks {self.num_local}..{tp - 1} join from other hosts, which needs a shared secret: set "
                f"{DISTRIBUTED_SECRET_ENV} (or --distributed-secret) here and on every worker"
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        check_choices(self)
        for name, low in (("ray_max_restarts", 0), ("routing_affinity_blocks", 1), ("routing_max_imbalance", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.uses_ray and self.num_local < self.tensor_parallel_size:
            raise ValueError("with Ray, every tensor-parallel rank of a replica runs on the replica's node: "
                             "drop --num-local-workers")

    @property
    def uses_ray(self) -> bool:
        return self.distributed_executor_backend == "ray" or self.ray_address is not None

    @property
    def uses_dp_client(self) -> bool:
        """Whether the front end talks to its core(s) through DPCoreClient (several replicas, or Ray)."""
        return self.data_parallel_size > 1 or self.uses_ray

    @property
    def num_local(self) -> int:
        """Ranks started on this host."""
        return self.tensor_parallel_size if self.num_local_workers is None else self.num_local_workers


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (pagedllm/lora/): requests may name a PEFT LoRA adapter of the base model."""

    enable_lora: bool = False
    """Serve LoRA adapters: a request may name one (offline: lora_request; server: its model field)."""
    max_loras: int = 1
    """Adapters resident at once, hence most distinct adapters in one step (the others wait)."""
    max_lora_rank: int = 16
    """Highest adapter rank accepted (the slots' width)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory, least recently used dropped first; default max_loras."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


