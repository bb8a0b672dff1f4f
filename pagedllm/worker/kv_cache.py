"""The KV cache tensors: one per layer, sized from a memory budget.

Layout of each layer's tensor (a block id indexes every layer):

    [2, num_blocks, block_size, num_kv_heads, head_dim]
     ^ 0 = K, 1 = V

Flattening (num_blocks, block_size) gives one row per token slot, so writing new K/V is one
indexed copy through the slot mapping and reading a block table is one gather.

The element type is the model's unless ``kv_cache_dtype`` names a narrower one (float16 or
bfloat16 on the CPU): blocks are sized from it, so the same memory holds twice the blocks, and
the device cache, the host swap cache and copy-on-write copies all share it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedllm.config import CacheConfig
from pagedllm.distributed.shapes import config_tp_shape, head_dim_of
from pagedllm.model import huge_pages

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    """The cache's element type (the model's, or a narrower one from kv_cache_dtype)."""

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for `block_size` tokens."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for_memory(self, kv_cache_memory: int) -> int:
        return kv_cache_memory // self.bytes_per_block

    @classmethod
    def for_model(cls, hf_config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> KVCacheSpec:
        """The cache of one rank: with tensor parallelism each rank caches only its own KV heads."""
        return cls(num_layers=hf_config.num_hidden_layers, num_kv_heads=config_tp_shape(hf_config, tp_size).num_kv_heads,
                   head_dim=head_dim_of(hf_config), block_size=block_size, dtype=dtype)


_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device | str,
                           tensor_parallel_size: int = 1, attention_backend: str = "auto") -> torch.dtype:
    """The cache's element type: 'auto' = the model's dtype. A narrower cache than the compute dtype
    is supported where attention widens it on read: the CPU backends (compiled op and reference)."""
    if name == "auto":
        return model_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_KV_DTYPES)}, got {name!r}")
    dtype = _KV_DTYPES[name]
    if dtype == model_dtype:
        return dtype
    if torch.device(device).type != "cpu" or attention_backend == "triton":
        # The Triton kernels read and write the cache in the compute dtype; none of them is tested
        # with another one, so refuse rather than risk silently wrong attention.
        raise ValueError(f"kv_cache_dtype={name} differs from the model's dtype "
                         f"({str(model_dtype).removeprefix('torch.')}); on {torch.device(device).type} and with "
                         f"the triton backend the KV cache must use the model's dtype: pass --kv-cache-dtype auto")
    if tensor_parallel_size > 1:
        raise ValueError(f"kv_cache_dtype={name} with tensor_parallel_size > 1 is not supported yet (the workers "
                         f"allocate their caches in the model's dtype); pass --kv-cache-dtype auto")
    return dtype


def num_kv_blocks(spec: KVCacheSpec, cache_config: CacheConfig, profiled: int | None = None,
                  draft_spec: KVCacheSpec | None = None) -> tuple[int, int]:
    """(device blocks, host swap blocks): an explicit count, else what profiling found (CUDA), else
    kv_cache_memory's worth; host blocks only for preemption_mode='swap'. With a draft model each
    block id holds the draft's KV too (worker/draft_proposer.py), so a block costs both."""
    bytes_per_block = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec is not None else 0)
    num_blocks = cache_config.num_kv_blocks or profiled
    if num_blocks is None:
        assert cache_config.kv_cache_memory is not None, "size an unset kv_cache_memory first (with_default_kv_memory)"
        num_blocks = cache_config.kv_cache_memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={cache_config.kv_cache_memory} bytes is less than one KV block "
            f"({bytes_per_block} bytes); raise it"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%s, %.1f MiB, %d KiB per block%s): at most %d tokens in flight",
        num_blocks, spec.block_size, str(spec.dtype).removeprefix("torch."), num_blocks * bytes_per_block / 2**20,
        bytes_per_block // 1024, " with the draft model's" if draft_spec is not None else "", num_blocks * spec.block_size,
    )
    num_host_blocks = 0
    if cache_config.preemption_mode == "swap":
        num_host_blocks = cache_config.swap_space // bytes_per_block
        logger.info("Swap space: %d host blocks", num_host_blocks)
    return num_blocks, num_host_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if torch.device(device).type == "cpu":  # every step streams these: 2 MB pages where the kernel allows
        return [huge_pages.zeros(shape, spec.dtype) for _ in range(spec.num_layers)]
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
