"""Physical KV blocks: ref counts, an O(1) LRU free queue and the prefix-hash table.

A block with ref_cnt 0 sits in the free queue. If it holds a cached prefix (it has a
hash), it stays findable through `cached_blocks` until a fresh block is needed and it
reaches the head of the queue: least recently freed goes first.

Every block is in exactly one state, and the pool counts each as it changes (so reading the
gauges costs nothing, however large the pool):

    used    ref_cnt > 0                      held by requests (shared when ref_cnt > 1)
    cached  ref_cnt == 0, block_hash set     in the free queue, still findable: reclaimable
    empty   ref_cnt == 0, no hash            in the free queue

    free queue:  head -> [evicted first] <-> ... <-> [freed last] <- tail

The table's key, a full block's prefix hash, is a SHA-256 chain over the blocks before it:

    block 0: sha256(b""      | tokens[0:16]  | extra keys)
    block 1: sha256(hash(0)  | tokens[16:32] | extra keys)
    ...

A differing token changes its block's hash and every hash after it, never one before it:
exactly the semantics of a prefix. The encoding is stable across processes and runs
(fixed-width integers, length prefixes); Python's `hash()` and pickle are not.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

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


_REF_CNT = operator.attrgetter("ref_cnt")
_NUM_TOKENS = operator.attrgetter("num_tokens")


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block; its id indexes every layer's K and V cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    """Set once the block is full and cached; cleared on eviction."""
    token_ids: tuple[int, ...] | None = None
    """The tokens the cached block holds, compared on a hit so a hash collision can never serve foreign KV."""
    num_tokens: int = 0
    """Slots holding KV (or written in the step being scheduled); set by the KV cache manager
    (`BlockPool.set_num_tokens`). A free block keeps its count only while it holds a cached prefix."""
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """A doubly linked list of free blocks: pop the head, append at the tail, remove from anywhere in O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(block_id=-1)  # sentinels keep the link code branch-free
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not self._tail, "pop from an empty free queue"
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """The free block ids in eviction order (for tests and leak checks)."""
        ids = []
        block = self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All physical blocks, who holds them, and which cached prefixes they contain."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.evict_listener: Callable[[KVBlock], None] | None = None
        """Told of each cached block about to lose its content (the disk tier spills it: core/kv_disk_tier.py)."""
        # Gauges kept as blocks change state (see the module docstring); a scan must agree (tests).
        self.num_cached_free_blocks = 0
        """Free blocks still holding a cached prefix: reclaimable, reused by a hit."""
        self.num_shared_blocks = 0
        """Blocks with ref_cnt > 1."""
        self.num_block_refs = 0
        """The sum of every block's ref_cnt: block-table entries over all sequences."""
        self.num_filled_slots = 0
        """The sum of num_tokens over used blocks."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached or not: all of them can be handed out."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting cached content."""
        assert num_blocks <= self.num_free_blocks, f"asked for {num_blocks}, {self.num_free_blocks} free"
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            block.num_tokens = 0
            blocks.append(block)
        self.num_block_refs += num_blocks
        return blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block with this hash *and* these tokens, or None."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks; a block that was free leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_filled_slots += block.num_tokens
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            elif block.ref_cnt == 1:
                self.num_shared_blocks += 1
            block.ref_cnt += 1
            self.num_block_refs += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Register a full block under its hash. An existing entry for the hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached_blocks[block_hash] = block
        if block.ref_cnt == 0:
            self.num_cached_free_blocks += 1

    def set_num_tokens(self, block: KVBlock, num_tokens: int) -> None:
        """Record how many of a used block's slots hold KV."""
        assert block.ref_cnt > 0, f"{block} is free"
        self.num_filled_slots += num_tokens - block.num_tokens
        block.num_tokens = num_tokens

    def fill_table(self, blocks: list[KVBlock], first: int, num_tokens: int, block_size: int) -> None:
        """Blocks `first`.. of a block table hold the tokens up to `num_tokens` (the rest of the table is ahead).
        On every request's every step: set_num_tokens inlined."""
        bs = block_size
        for i in range(first, min(len(blocks), -(-num_tokens // bs))):
            block = blocks[i]
            filled = num_tokens - i * bs
            if filled > bs:
                filled = bs
            if block.num_tokens < filled:
                self.num_filled_slots += filled - block.num_tokens
                block.num_tokens = filled

    def unfill_after_rollback(self, kept: list[KVBlock], num_tokens: int, block_size: int) -> None:
        """Speculative rollback: the kept blocks of a table hold exactly the first `num_tokens` slots. Only the last
        private blocks can be off (proposals write nowhere else), so walk back until one agrees."""
        bs = block_size
        for i in range(len(kept) - 1, -1, -1):
            filled = max(0, min(bs, num_tokens - i * bs))
            block = kept[i]
            if block.num_tokens == filled or block.ref_cnt != 1:  # shared, or the null block
                break
            self.set_num_tokens(block, filled)

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (the first freed is evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            self.num_block_refs -= 1
            if block.ref_cnt == 1:
                self.num_shared_blocks -= 1
            elif block.ref_cnt == 0:
                self.free_queue.append(block)
                self.num_filled_slots -= block.num_tokens
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1
                else:
                    block.num_tokens = 0  # an empty block holds nothing; a cached one keeps its full block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        self.num_cached_free_blocks -= 1  # only free blocks are evicted
        if self.evict_listener is not None:
            self.evict_listener(block)
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1

    def block_states(self) -> tuple[list[int], list[int], list[int]]:
        """Every block's ref_cnt and the slots holding KV (index = block id; a cached free block holds a full
        block's), and the free blocks still holding a cached prefix: a full walk, for a picture of the pool (the
        dashboard), not for gauges."""
        cached = sorted(b.block_id for b in self.cached_blocks.values() if not b.ref_cnt)
        return list(map(_REF_CNT, self.blocks)), list(map(_NUM_TOKENS, self.blocks)), cached

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
            block.num_tokens = 0
        self.cached_blocks.clear()
        self.num_cached_free_blocks = 0
        return True
