"""The KV cache tensors: one per layer, sized from a memory budget.

Layout of each layer's tensor (a block id indexes every layer):

    [2, num_blocks, block_size, num_kv_heads, head_dim]
     ^ 0 = K, 1 = V

Flattening (num_blocks, block_size) gives one row per token slot, so writing new K/V is one
indexed copy through the slot mapping and reading a block table is one gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for `block_size` tokens."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for_memory(self, kv_cache_memory: int) -> int:
        return kv_cache_memory // self.bytes_per_block


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
