"""How many KV blocks an executor gets, and the KVCacheInfo it reports to the engine core.

The block count itself comes from `kv_cache.num_kv_blocks` (kv_cache_memory, or on CUDA what
`profile_num_kv_blocks` measures is left of gpu_memory_utilization after the weights and the peak
activations).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.model.forward_context import set_forward_context
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
