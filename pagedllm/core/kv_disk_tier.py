"""The disk tier joined to the block pool: what a step spills to disk and loads back.

    eviction      BlockPool._evict tells the tier (`on_evict`) before a cached block is reused; the
                  block's id goes into the step's `kv_spill`, and the worker copies its K/V out before
                  anything writes to it (worker/kv_block_io.py). The bytes come back with the step's
                  output (`complete`) and are queued for the store's writer thread.
    prefix miss   KVCacheManager.get_computed_blocks asks `load_prefix` to go on where memory's hits
                  end: each further block found on disk (and checked) gets a fresh block registered
                  under its hash, and its bytes go into the step's `kv_load`, written into the cache
                  before the forward pass. The loaded blocks are then ordinary cached blocks: the
                  request attaches them like any memory hit.

    worker order in a step:  kv_spill (read)  ->  swap_out  ->  kv_load (write)  ->  swap_in, copies, forward

A block loaded and evicted again within one schedule is dropped from `kv_load` (nothing reads it, and
its bytes are already on disk), so a step never writes a stale load over a block's new owner.
"""

from __future__ import annotations

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.kv_disk_store import KVDiskStore
from pagedllm.core.request import Request


class DiskTier:
    """Spills the pool's evicted cached blocks to ``store`` and loads prefix hits back from it."""

    def __init__(self, store: KVDiskStore, pool: BlockPool, block_size: int) -> None:
        self.store = store
        self.pool = pool
        self.block_size = block_size
        self.hit_tokens = 0
        """Prefix tokens served from disk (they also count in the manager's prefix_cache_hits)."""
        self._spills: list[tuple[int, BlockHash, tuple[int, ...]]] = []
        self._loads: dict[int, bytes] = {}
        self._in_flight: list[tuple[BlockHash, tuple[int, ...]]] = []
        pool.evict_listener = self._on_evict

    def _on_evict(self, block: KVBlock) -> None:
        if self._loads.pop(block.block_id, None) is not None:
            return  # loaded from disk this very step: its bytes are on disk already, and nothing read them
        if block.block_hash in self.store or not self.store.enabled:
            return
        self._spills.append((block.block_id, block.block_hash, block.token_ids))

    def load_prefix(self, request: Request, start: int, stop: int, held: list[KVBlock]) -> list[KVBlock]:
        """Blocks ``start..stop-1`` of the request's prompt read from disk into fresh cached blocks, as far as
        they are found in a row; ``held`` (the memory hits before them) are kept from eviction meanwhile."""
        if start >= stop or not self.store.enabled:
            return []
        if request.block_hashes[start] not in self.store:
            self.store.stats.miss_blocks += 1
            return []
        pool, bs = self.pool, self.block_size
        pool.touch(held)  # a fresh block must never be one of this request's own hits
        loaded: list[KVBlock] = []
        try:
            for i in range(start, stop):
                block_hash = request.block_hashes[i]
                if pool.num_free_blocks < 1 or block_hash in pool.cached_blocks:
                    break
                tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
                payload = self.store.read(block_hash, tokens)
                if payload is None:
                    break
                block = pool.get_new_blocks(1)[0]
                pool.set_num_tokens(block, bs)
                pool.cache_block(block, block_hash, tokens)
                self._loads[block.block_id] = payload
                loaded.append(block)
        finally:
            pool.free_blocks(reversed(loaded))  # cached and free, like any memory hit; the tail goes first
            pool.free_blocks(reversed(held))
        self.hit_tokens += len(loaded) * bs
        return loaded

    def take_step_io(self) -> tuple[list[int], list[tuple[int, bytes]]]:
        """The block ids to copy out and the (block id, bytes) to write in, for the step just scheduled."""
        spills, self._spills = self._spills, []
        loads, self._loads = list(self._loads.items()), {}
        self._in_flight = [(h, t) for _, h, t in spills]
        return [block_id for block_id, _, _ in spills], loads

    def persist(self, read_blocks) -> int:
        """Queue every cached block that is not on disk yet (at shutdown, so a restart finds what memory held);
        ``read_blocks(ids) -> [bytes]`` copies them out. Returns how many were queued."""
        if not self.store.enabled:
            return 0
        blocks = [b for b in self.pool.cached_blocks.values() if b.block_hash not in self.store]
        for block, payload in zip(blocks, read_blocks([b.block_id for b in blocks])):
            self.store.store(block.block_hash, block.token_ids, payload, wait=True)
        return len(blocks)

    def complete(self, payloads: list[bytes]) -> None:
        """The spilled blocks' bytes, in `take_step_io`'s order: queued for the disk."""
        in_flight, self._in_flight = self._in_flight, []
        for (block_hash, tokens), payload in zip(in_flight, payloads):
            self.store.store(block_hash, tokens, payload)
