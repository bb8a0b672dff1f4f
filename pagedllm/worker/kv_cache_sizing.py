"""How many KV blocks an executor gets, and the KVCacheInfo it reports to the engine core.

The block count itself comes from `kv_cache.num_kv_blocks` (kv_cache_memory, or on CUDA what
`profile_num_kv_blocks` measures is left of gpu_memory_utilization after the weights and the peak
activations). A kv_cache_memory left unset is sized here by the default rule (`config/kv_budget.py`), from the
model's weight files and the memory available.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from pagedllm.config import CacheConfig
from pagedllm.config.kv_budget import default_kv_cache_bytes, describe
from pagedllm.model.forward_context import set_forward_context
from pagedllm.model.loader import gguf_source
from pagedllm.worker.interface import KVCacheInfo
from pagedllm.worker.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_num_kv_blocks(model: nn.Module, bytes_per_block: int, num_tokens: int, num_seqs: int,
                          gpu_memory_utilization: float, device: torch.device) -> int:
    """Blocks that fit in ``gpu_memory_utilization`` of the GPU after weights and peak activations.

    A dummy forward of ``num_tokens`` tokens (the step budget) without a KV cache, plus logits for
    ``num_seqs`` rows, measures the activation peak; everything already in use on the device
    (weights, the CUDA context, other processes) is subtracted too.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    with set_forward_context(None, None):
        hidden = model(input_ids, positions)
        model.compute_logits(hidden[:num_seqs])
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    del hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization) - (total - free) - activation_peak
    logger.info("GPU memory: %.1f GiB total, %.1f GiB in use, %.2f GiB activation peak -> %.1f GiB for KV",
                total / 2**30, (total - free) / 2**30, activation_peak / 2**30, max(budget, 0) / 2**30)
    return max(budget, 0) // bytes_per_block


def kv_cache_info(spec: KVCacheSpec, num_blocks: int, num_host_blocks: int,
                   draft_spec: KVCacheSpec | None = None, sliding_window: int | None = None) -> KVCacheInfo:
    bytes_per_block = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec is not None else 0)
    return KVCacheInfo(num_blocks=num_blocks, num_host_blocks=num_host_blocks, block_size=spec.block_size,
                       bytes_per_block=bytes_per_block, num_kv_heads=spec.num_kv_heads, sliding_window=sliding_window)


def shared_sliding_window(*models) -> int | None:
    """The window every attention layer of `models` uses, or None if one layer reads the whole context
    (or the windows differ: Gemma's local/global mix keeps every block, see docs/design.md)."""
    windows = [w for model in models for w in (getattr(model, "sliding_windows", None) or [None])]
    return windows[0] if windows and all(w == windows[0] for w in windows) else None


def with_default_kv_memory(cache_config: CacheConfig, bytes_per_block: int, max_model_len: int, model: str | None,
                           num_ranks: int = 1) -> CacheConfig:
    """`cache_config` with kv_cache_memory sized by the default rule when the user left it (and num_kv_blocks)
    unset; the rule, and what it gave, logged. `num_ranks`: tensor-parallel ranks; each rank's budget is for its
    share of the weights and of the memory (as though every rank ran on this host)."""
    if cache_config.kv_cache_memory is not None or cache_config.num_kv_blocks is not None:
        return cache_config
    weights = model_weight_bytes(model)
    available = available_memory_bytes()
    bytes_per_token = max(1, bytes_per_block // cache_config.block_size)
    budget = default_kv_cache_bytes(
        bytes_per_token, max_model_len, None if weights is None else weights // num_ranks,
        None if available is None else available // num_ranks)
    logger.info("KV cache memory (default rule: room for 16 requests of 2048 tokens, at most 4x the weight files "
                "and 25%% of available memory; --kv-cache-memory overrides): %.1f MiB, limited by %s "
                "(weight files %s, available memory %s)", budget.num_bytes / 2**20, describe(budget),
                _mib(weights), _mib(available))
    return dataclasses.replace(cache_config, kv_cache_memory=budget.num_bytes)


def _mib(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else f"{num_bytes / 2**20:.0f} MiB"


def model_weight_bytes(model: str | None) -> int | None:
    """The size of `model`'s weight files: its GGUF (the embedded default's too), or a directory's *.safetensors
    (else *.bin); None when there are none."""
    gguf = gguf_source(model)
    if gguf is not None:
        return gguf.stat().st_size
    directory = Path(model).expanduser() if model is not None else None
    if directory is None or not directory.is_dir():
        return None
    for pattern in ("*.safetensors", "*.bin"):
        files = list(directory.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    return None


def available_memory_bytes() -> int | None:
    """Memory available to this process now: the kernel's MemAvailable, or what is left under a cgroup (v2) limit
    when that is less; None when neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available
