"""KV blocks moved whole, outside the forward pass: swapped between the device and host caches, copied
within a cache (copy-on-write), and turned into bytes and back (what the disk tier stores, core/kv_disk_tier.py).
The runner calls here only with blocks to move.

A block's bytes are every cache tensor's ``[:, block]`` slice (K then V, layer after layer, the draft
model's caches after the target's, as the runner lists them), each in its own element type. Reading
a block back writes exactly those bytes, so a loaded block is bitwise the block that was spilled.
"""

from __future__ import annotations

import torch


def swap_blocks(mapping: list[tuple[int, int]], src_caches: list[torch.Tensor],
                dst_caches: list[torch.Tensor]) -> None:
    """Copy each ``(src, dst)`` block of ``src_caches`` into ``dst_caches`` (device <-> host, same layout)."""
    src = torch.tensor([s for s, _ in mapping])
    dst = torch.tensor([d for _, d in mapping])
    for src_cache, dst_cache in zip(src_caches, dst_caches):
        dst_cache[:, dst.to(dst_cache.device)] = src_cache[:, src.to(src_cache.device)].to(dst_cache.device)


def copy_blocks(copies: list[tuple[int, int]], caches: list[torch.Tensor]) -> None:
    """Copy each ``(src, dst)`` block within every cache (a shared block made private before a write)."""
    src = torch.tensor([s for s, _ in copies])
    dst = torch.tensor([d for _, d in copies])
    for cache in caches:
        cache[:, dst.to(cache.device)] = cache[:, src.to(cache.device)]


def read_blocks(caches: list[torch.Tensor], block_ids: list[int]) -> list[bytes]:
    """Each block's K/V over ``caches`` as one bytes object."""
    return [b"".join(_as_bytes(cache[:, block_id]) for cache in caches) for block_id in block_ids]


def write_blocks(caches: list[torch.Tensor], loads: list[tuple[int, bytes]]) -> None:
    """Write each ``(block id, bytes)`` of ``read_blocks``' layout into ``caches``."""
    for block_id, payload in loads:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for cache in caches:
            target = cache[:, block_id]
            size = target.numel() * target.element_size()
            if offset + size > data.numel():
                raise ValueError(f"a KV block of {data.numel()} bytes for caches that hold more")
            target.copy_(data[offset : offset + size].view(cache.dtype).view(target.shape))
            offset += size
        if offset != data.numel():
            raise ValueError(f"a KV block of {data.numel()} bytes for caches that hold {offset}")


def block_bytes(caches: list[torch.Tensor]) -> int:
    """Bytes of one block over ``caches``."""
    return sum(cache[:, 0].numel() * cache.element_size() for cache in caches)


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
