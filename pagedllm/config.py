"""Frozen, validated configs, and the engine arguments they are made from."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_memory_size(value: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain integers are bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read a memory size from {value!r}; use e.g. 2GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _parse_bool(value: str | bool) -> bool:
    """'true'/'1'/'yes' or 'false'/'0'/'no' (so every engine flag can be passed as --flag VALUE)."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int = 1 << 30
    """Bytes for the KV cache of all layers (ignored when num_kv_blocks is set)."""
    num_kv_blocks: int | None = None
    """An explicit block count, overriding kv_cache_memory."""
    enable_prefix_caching: bool = True
    """Reuse the cached KV of full blocks shared with earlier requests."""
    preemption_mode: str = "recompute"
    """How a preempted request gets its KV back: 'recompute' it, or 'swap' it out to host memory."""
    swap_space: int = 1 << 30
    """Bytes of host memory for swapped-out blocks (used with preemption_mode='swap')."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) served."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class EngineArgs:
    """Everything a user can set when starting an engine; each field is also a CLI flag."""

    model: str | None = None
    """A Hugging Face model directory or a .gguf file; None for the embedded default."""
    dtype: str = "auto"
    """Weight and activation dtype; 'auto' = float32 on the CPU (bf16 matmuls are far slower there),
    bfloat16 on CUDA."""
    seed: int = 0
    """Seed of the engine's shared random generator (unseeded sampling)."""
    block_size: int = 16
    kv_cache_memory: int | str = 1 << 30
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int | str = 1 << 30
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    """Defaults to the model's context length, capped at 4096."""
    kv_allocation_policy: str = "paged"
    """'paged', or a contiguous-reservation baseline for benchmarks: 'max', 'pow2' or 'oracle'
    (core/contiguous_allocator.py)."""
    kv_allocator: str = "first_fit"
    """Placement of contiguous reservations: 'first_fit' or 'buddy' (unused by 'paged')."""
    device: str = "auto"
    """'auto' (CUDA when torch sees a GPU, else the CPU), 'cpu' or 'cuda'."""
    gpu_memory_utilization: float = 0.9
    """CUDA only: fraction of GPU memory for weights, activations and KV cache; the KV cache gets
    what a profiling forward pass leaves (the CPU uses kv_cache_memory)."""
    enforce_eager: bool = False
    """CUDA only: run decode steps eagerly instead of replaying CUDA graphs."""
    attention_backend: str = "auto"
    """'auto' (triton on CUDA, torch on the CPU), 'torch' (the PyTorch reference) or 'triton'."""
    num_threads: int | None = None
    """CPU intra-op threads of the process that runs the model (tensor_parallel_size 1); None keeps
    torch's default, the cores this process may run on. Tensor-parallel workers split the
    machine's cores among themselves."""

    tensor_parallel_size: int = 1
    """Worker processes, one model shard each (1: the model runs in the engine's process).
    With N > 1, kv_cache_memory is each rank's budget for its share of the KV heads."""
    master_addr: str = "127.0.0.1"
    """Address of the torch.distributed rendezvous (this host, reachable by every worker)."""
    master_port: int | None = None
    """Port of the rendezvous; None picks a free one (set it when workers run on other hosts)."""
    num_local_workers: int | None = None
    """Ranks 0..k-1 are started here; the others join with `pagedllm worker`. None: all of them."""
    distributed_timeout: float = 120.0
    """Seconds a collective, worker start-up or step may wait for a peer before the engine dies."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=parse_memory_size(self.kv_cache_memory),
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            preemption_mode=self.preemption_mode,
            swap_space=parse_memory_size(self.swap_space),
        )

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_model_len = self.max_model_len if self.max_model_len is not None else min(model_max_len, 4096)
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context length ({model_max_len})"
            )
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
        parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                            help="auto: float32 on the CPU, bfloat16 on CUDA")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 2GiB")
        parser.add_argument("--num-kv-blocks", type=int, default=None)
        parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
        parser.add_argument("--swap-space", default="1GiB", help="host memory for swapped-out KV blocks")
        parser.add_argument("--max-num-seqs", type=int, default=128)
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--kv-allocation-policy", default="paged", choices=["paged", "max", "pow2", "oracle"],
                            help="KV allocation: paged, or a contiguous-reservation baseline (benchmarks)")
        parser.add_argument("--kv-allocator", default="first_fit", choices=["first_fit", "buddy"],
                            help="placement of contiguous reservations (non-paged policies)")
        gpu = parser.add_argument_group("device")
        gpu.add_argument("--device", default="auto", help="auto, cpu or cuda")
        gpu.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                         help="CUDA: fraction of GPU memory to use (the KV cache gets what is left)")
        gpu.add_argument("--enforce-eager", nargs="?", const=True, default=False, type=_parse_bool,
                         help="CUDA: no CUDA graphs for decode (a bare flag means true)")
        gpu.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
        gpu.add_argument("--num-threads", type=int, default=None,
                         help="CPU threads for the model (default: the cores this process may use)")
        group = parser.add_argument_group("tensor parallelism")
        group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                           help="worker processes, one model shard each")
        group.add_argument("--master-addr", default="127.0.0.1",
                           help="this host's address for the workers' rendezvous (multi-host)")
        group.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
        group.add_argument("--num-local-workers", type=int, default=None,
                           help="ranks started on this host (the rest join with 'pagedllm worker'); default all")
        group.add_argument("--distributed-timeout", type=float, default=120.0,
                           help="seconds to wait for a worker before declaring the engine dead")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
