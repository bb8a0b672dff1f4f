"""EngineArgs: everything a user can set when starting an engine, as one flat dataclass (the Python
keywords of `LLM(...)` and the flags of `pagedllm generate/chat/serve`).

A setting that a runtime config owns is declared there, once: here it is a `setting(Config, name)`
line, which copies that field's default, choices, parser and help. The runtime configs validate their
own fields; `EngineArgs.__post_init__` builds each of them once, so a bad value is refused when the
engine is configured, with the config's own error naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.config.flags import add_flags, check_choices, flag, parse_memory_size
from pagedllm.config.runtime import (
    CacheConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RequestLimits,
    SchedulerConfig,
    SpeculativeConfig,
    parse_kv_cache_memory,
    parse_speculative_config,
)

DTYPES = ("auto", "float32", "float16", "bfloat16", "bf16-matmul")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
RUNNERS = ("generate", "pooling", "both")
_TP, _DP, _LIMITS, _DEVICE = "tensor parallelism", "data parallelism", "request limits", "device"
_LORA = "LoRA adapters"


def setting(config_cls, name: str, *, aliases: tuple[str, ...] = (), group: str | None = None,
            negative: str | None = None):
    """The EngineArgs field for `config_cls`'s field `name`: its default, choices, parser, repr and help
    (its docstring, read when a parser is built) are the config's; aliases, group and negative only say how
    the flag is spelled."""
    owner = {f.name: f for f in dataclasses.fields(config_cls)}[name]
    meta = owner.metadata
    metadata = {"help": meta.get("help"), "choices": meta.get("choices"), "parse": meta.get("parse"),
                "aliases": aliases, "group": group, "negative": negative, "owner": config_cls}
    return dataclasses.field(default=owner.default, metadata=metadata, repr=owner.repr)


@dataclass
class EngineArgs:
    """Everything a user can set when starting an engine; each field is also a CLI flag (`add_cli_args`)."""

    model: str | None = flag(None, "A Hugging Face model directory or a .gguf file (default: the embedded "
                                   "SmolLM2-135M-Instruct).")
    dtype: str = flag("auto", "Weight and activation dtype; auto = float32 on the CPU (bf16 matmuls are far "
                              "slower there), bfloat16 on CUDA, and bf16-matmul for runner pooling on a CPU with "
                              "AMX-BF16. bf16-matmul (runner pooling, CPU): float32, but the layers' linears "
                              "multiply bf16-rounded inputs and weights into float32 sums on AMX tiles.",
                      choices=DTYPES)
    gguf_dequantize: bool = flag(False, "Dequantize a GGUF's quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                                        "IQ4_NL, Q3_K, Q4_K, Q5_K, Q6_K) to float32 at load instead of running them quantized through the compiled CPU "
                                        "kernels.")
    quantization: str = flag("auto", "How an unquantized checkpoint's weights are kept on the CPU: auto (a bf16 "
                                     "checkpoint stays bf16 where the compiled kernel runs, widened in registers "
                                     "with float32 accumulation; else float32), int8 (weight-only, quantized at load "
                                     "to Q8_0: int8 with one fp16 scale per 32 weights of a row, finer than "
                                     "per-channel scales), bf16 (float32 weights rounded to bf16) or float32.",
                             choices=("auto", "int8", "bf16", "float32"))
    quant_activations: str = flag("auto", "Activations of the linears with quantized weights. auto: int8 "
                                          "for a GGUF's quantized weights (Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL "
                                          "/ Q3_K / Q4_K / Q5_K / Q6_K) on the CPU in "
                                          "float32, where the int8 kernel runs (AVX2 at least; else float32, "
                                          "logged); float checkpoints, also --quantization int8 ones, and the "
                                          "embedded default model keep float32. int8: each linear's input quantized per 32-wide block of a "
                                          "row to int8, integer dot products with the weights (faster, a small "
                                          "accuracy cost: docs/int8-activations.md); refused where it cannot "
                                          "run. none: float32 activations, the exact mode (greedy tokens equal "
                                          "transformers' on the same weights).",
                                  choices=("auto", "none", "int8"))
    runner: str = flag("generate", "What the model serves: generate (text), pooling (embeddings as its "
                                   "sentence-transformers files say, docs/embeddings.md; generation refused) or "
                                   "both (a decoder with its LM head: text, and embeddings of prompts pooled in "
                                   "the same batches; by default its last token, normalized).",
                       choices=RUNNERS)
    seed: int = flag(0, "Seed of the engine's shared random generator (unseeded sampling).")
    generation_config: str = flag("auto", "Where the sampling defaults of a request that leaves them unset come from "
                                          "(temperature, top_p, top_k, min_p, repetition_penalty): auto = the model's "
                                          "generation_config.json (the embedded model: its card's temperature 0.2, "
                                          "top_p 0.9); vllm or none = no model defaults; or a directory holding a "
                                          "generation_config.json.")
    block_size: int = setting(CacheConfig, "block_size")
    kv_cache_dtype: str = flag("auto", "Element type of the KV cache; auto = the model's dtype. float16 or bfloat16 "
                                       "on a float32 model halves the K/V that attention reads and doubles the "
                                       "blocks that fit in the same memory (lossy: K/V are rounded on write, "
                                       "attention still computes in float32). CPU only when it differs from "
                                       "--dtype.", choices=KV_CACHE_DTYPES)
    kv_cache_memory: int | str | None = setting(CacheConfig, "kv_cache_memory")
    num_kv_blocks: int | None = setting(CacheConfig, "num_kv_blocks")
    enable_prefix_caching: bool = setting(CacheConfig, "enable_prefix_caching", negative="--no-prefix-caching")
    preemption_mode: str = setting(CacheConfig, "preemption_mode")
    swap_space: int | str = setting(CacheConfig, "swap_space")
    kv_disk_cache: str | None = setting(CacheConfig, "kv_disk_cache")
    kv_disk_cache_size: int | str = setting(CacheConfig, "kv_disk_cache_size")
    max_num_seqs: int = setting(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int | None = setting(SchedulerConfig, "max_num_batched_tokens")
    max_model_len: int | None = setting(SchedulerConfig, "max_model_len")
    scheduling_policy: str = setting(SchedulerConfig, "scheduling_policy")
    speculative_config: dict | None = flag(None, "Speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", "
                                           "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' (default: off).",
                                           parse=parse_speculative_config)
    device: str = flag("auto", "auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N.", group=_DEVICE)
    gpu_memory_utilization: float = flag(0.9, "CUDA only: fraction of GPU memory for weights, activations and KV "
                                              "cache; the KV cache gets what a profiling forward pass leaves (the "
                                              "CPU uses kv_cache_memory).", group=_DEVICE)
    enforce_eager: bool = flag(False, "CUDA only: run decode steps eagerly instead of replaying CUDA graphs.",
                               group=_DEVICE)
    attention_backend: str = flag("auto", "auto (triton on CUDA; on the CPU the compiled op when it is built, else "
                                          "torch), torch (the PyTorch reference), cpu (the compiled CPU op) or "
                                          "triton.", choices=ATTENTION_BACKENDS, group=_DEVICE)
    batch_invariant: bool = flag(False, "CPU only: one request's logits (and logprobs) bitwise the same alone and "
                                        "in any batch, whatever the prompt's chunking, prefix-cache hits, preemption, "
                                        "speculative decoding and thread count, at a given tensor_parallel_size; "
                                        "kernels with a fixed per-row sum order, slower "
                                        "(pagedllm/model/batch_invariant.py).", group=_DEVICE)
    num_threads: int | None = flag(None, "CPU intra-op threads of the process that runs the model (tensor_parallel_size "
                                         "1); default: torch's, the cores this process may run on.", group=_DEVICE)

    tensor_parallel_size: int = setting(ParallelConfig, "tensor_parallel_size", aliases=("-tp",), group=_TP)
    master_addr: str = setting(ParallelConfig, "master_addr", group=_TP)
    master_port: int | None = setting(ParallelConfig, "master_port", group=_TP)
    num_local_workers: int | None = setting(ParallelConfig, "num_local_workers", group=_TP)
    distributed_timeout: float = setting(ParallelConfig, "distributed_timeout", group=_TP)
    distributed_secret: str | None = setting(ParallelConfig, "distributed_secret", group=_TP)

    data_parallel_size: int = setting(ParallelConfig, "data_parallel_size", aliases=("-dp",), group=_DP)
    distributed_executor_backend: str = setting(ParallelConfig, "distributed_executor_backend", group=_DP)
    ray_address: str | None = setting(ParallelConfig, "ray_address", group=_DP)
    ray_max_restarts: int = setting(ParallelConfig, "ray_max_restarts", group=_DP)
    routing: str = setting(ParallelConfig, "routing", group=_DP)
    routing_affinity_blocks: int = setting(ParallelConfig, "routing_affinity_blocks", group=_DP)
    routing_max_imbalance: int = setting(ParallelConfig, "routing_max_imbalance", group=_DP)

    max_stop_token_ids: int = setting(RequestLimits, "max_stop_token_ids", group=_LIMITS)
    max_logit_bias: int = setting(RequestLimits, "max_logit_bias", group=_LIMITS)
    max_stop_strings: int = setting(RequestLimits, "max_stop_strings", group=_LIMITS)
    max_stop_string_chars: int = setting(RequestLimits, "max_stop_string_chars", group=_LIMITS)
    max_logprobs: int = setting(RequestLimits, "max_logprobs", group=_LIMITS)
    max_sequences_per_request: int = setting(RequestLimits, "max_sequences_per_request", group=_LIMITS)
    max_prompt_logprobs_positions: int = setting(RequestLimits, "max_prompt_logprobs_positions", group=_LIMITS)

    enable_lora: bool = setting(LoRAConfig, "enable_lora", group=_LORA)
    max_loras: int = setting(LoRAConfig, "max_loras", group=_LORA)
    max_lora_rank: int = setting(LoRAConfig, "max_lora_rank", group=_LORA)
    max_cpu_loras: int | None = setting(LoRAConfig, "max_cpu_loras", group=_LORA)

    def __post_init__(self) -> None:
        # Each runtime config validates its own fields: build each once, so a bad value is refused now.
        self.cache_config()
        self.scheduler_config()
        self.parallel_config()
        self.request_limits()
        self.speculative()
        self.lora_config()
        # The fields no runtime config owns (they choose the model, its device and kernels).
        check_choices(self)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.batch_invariant and self.device.startswith("cuda"):
            raise ValueError("batch_invariant runs on the CPU only")
        if self.batch_invariant and self.enable_lora:
            # nobody has shown the adapters' delta kernel (lora_sgmv_cpu) sums each row in a fixed order
            raise ValueError("batch_invariant does not cover LoRA adapters yet: turn off enable_lora or batch_invariant")
        if self.quantization in ("int8", "bf16") and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization {self.quantization!r} applies to float32 CPU models (dtype auto or "
                             f"float32), got dtype {self.dtype!r}")
        if self.quantization != "auto" and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization {self.quantization!r} does not support tensor_parallel_size > 1 yet "
                             "(a bf16 checkpoint is kept bf16 with quantization 'auto')")
        if self.quant_activations == "int8" and (self.device.startswith("cuda") or self.dtype not in ("auto", "float32")):
            raise ValueError("quant_activations 'int8' applies to float32 CPU models (auto falls back to float32 "
                             "activations elsewhere)")
        if self.dtype == "bf16-matmul" and (self.runner != "pooling" or self.device.startswith("cuda")):
            raise ValueError(f"dtype 'bf16-matmul' applies to runner 'pooling' on the CPU, got runner {self.runner!r} "
                             f"on device {self.device!r}")
        if self.runner != "generate":
            unsupported = {"tensor_parallel_size > 1": self.tensor_parallel_size > 1,
                           "speculative_config": self.speculative_config is not None, "enable_lora": self.enable_lora}
            refused = [name for name, given in unsupported.items() if given]
            if refused:
                raise ValueError(f"runner {self.runner!r} does not support {', '.join(refused)} yet")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    def _config(self, config_cls, **resolved):
        """`config_cls` from the same-named fields here; `resolved` replaces the ones given in another form."""
        return config_cls(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(config_cls)}, **resolved})

    def cache_config(self) -> CacheConfig:
        return self._config(CacheConfig, kv_cache_memory=self._bytes("kv_cache_memory", parse_kv_cache_memory),
                            swap_space=self._bytes("swap_space"), kv_disk_cache_size=self._bytes("kv_disk_cache_size"))

    def _bytes(self, name: str, parse=parse_memory_size) -> int | None:
        """A memory-size field ("2GiB" or a byte count) in bytes; a ValueError names the field."""
        try:
            return parse(getattr(self, name))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def scheduler_config(self, model_max_len: int | None = None, device_type: str = "cpu") -> SchedulerConfig:
        """The scheduler's config; given the model's context length and where it runs, with max_model_len and
        max_num_batched_tokens resolved (SchedulerConfig.for_model)."""
        config = self._config(SchedulerConfig)
        return config if model_max_len is None else config.for_model(model_max_len, device_type, self.runner)

    def parallel_config(self) -> ParallelConfig:
        return self._config(ParallelConfig,
                            distributed_secret=self.distributed_secret or envs.PAGEDLLM_DISTRIBUTED_SECRET or None)

    def request_limits(self) -> RequestLimits:
        return self._config(RequestLimits)

    def model_config(self) -> ModelConfig:
        return self._config(ModelConfig)

    def device_config(self) -> DeviceConfig:
        return self._config(DeviceConfig)

    def lora_config(self) -> LoRAConfig | None:
        """The validated LoRA config; None when enable_lora is off."""
        config = self._config(LoRAConfig)
        return config if config.enable_lora else None

    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative-decoding config; None when off."""
        return SpeculativeConfig.from_value(self.speculative_config)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
