"""The prefix-cache key of a full block: a SHA-256 chain over the blocks before it.

    block 0: sha256(b""      | tokens[0:16]  | extra keys)
    block 1: sha256(hash(0)  | tokens[16:32] | extra keys)
    ...

A differing token changes its block's hash and every hash after it, never one before it:
exactly the semantics of a prefix. The encoding is stable across processes and runs
(fixed-width integers, length prefixes); Python's `hash()` and pickle are not.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str] = (),
) -> BlockHash:
    """SHA-256 over (parent hash, the block's token ids, extra keys such as a cache salt)."""
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00" * 32)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode("utf-8")
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def prefix_extra_keys(cache_salt: str | None, lora_cache_key: str | None) -> tuple[str, ...]:
    """The extra keys every block hash of a request carries: its cache salt, and its LoRA adapter
    (an adapter's KV differs from the base's and every other adapter's). The engine core's cache and
    the data-parallel router hash with the same keys, so an affinity hit means a real cache hit."""
    keys: tuple[str, ...] = ()
    if cache_salt is not None:
        keys += (cache_salt,)
    if lora_cache_key is not None:
        keys += (lora_cache_key,)
    return keys


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `block_hashes`."""
    num_full_blocks = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        block_tokens = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block_tokens(parent, block_tokens, extra_keys))
