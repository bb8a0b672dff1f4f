"""The disk tier joined to the block pool: what a step spills to disk and loads back.

    eviction      BlockPool._evict tells the tier (`on_evict`) before a cached block is reused; the
                  block's id goes into the step's `kv_spill`, and the worker copies its K/V out before
                  anything writes to it (worker/kv_block_io.py). The bytes come back with the step's
                  output (`complete`) and are queued for the store's writer thread.
    prefix miss   Before admitting a waiting request, the scheduler asks `start_load` for the longest
                  hit memory and disk hold together: each of its blocks on disk gets a fresh block,
                  reserved now, and a read on the store's reader thread (with a sliding window, only
                  the blocks the hit's window reads). The request leaves the waiting queue (it is
                  "loading") while the other requests keep running. Each step `poll` takes the blocks
                  read (checked) since the last: each is registered in the prefix cache, and its bytes
                  go into that step's `kv_load`, written into the cache before the forward pass. Once
                  all of a request's blocks are in, it goes back to the front of the queue and attaches
                  them like any memory hit.

    a request's load:   start_load --(reads, off the step)--> poll: blocks cached, bytes in kv_load
                        --> back to the queue's front, still holding its hits --> admitted: release
                        (aborted while loading: release gives back its hits and its unread blocks)

    worker order in a step:  kv_spill (read)  ->  swap_out  ->  kv_load (write)  ->  swap_in, copies, forward

A block loaded and evicted again within one schedule is dropped from `kv_load` (nothing reads it, and
its bytes are already on disk), so a step never writes a stale load over a block's new owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.block_pool import KVBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_disk_store import KVDiskStore
from pagedllm.core.request import Request


@dataclass(slots=True)
class _Read:
    block: KVBlock
    """Reserved for the bytes; only the reader's reference holds it until they arrive."""
    tokens: tuple[int, ...]
    waiters: set[str]
    """The requests waiting for it."""


class DiskTier:
    """Spills the pool's evicted cached blocks to ``store`` and loads prefix hits back from it."""

    def __init__(self, store: KVDiskStore, manager: KVCacheManager) -> None:
        self.store = store
        self.manager = manager
        self.pool = pool = manager.pool
        self.block_size = manager.block_size
        self.hit_tokens = 0
        """Prefix tokens served from disk (they also count in the manager's prefix_cache_hits)."""
        self._spills: list[tuple[int, BlockHash, tuple[int, ...]]] = []
        self._loads: dict[int, bytes] = {}
        self._in_flight: list[tuple[BlockHash, tuple[int, ...]]] = []
        self._reads: dict[BlockHash, _Read] = {}
        """Blocks the reader is reading, each into a block of its own that no request holds yet."""
        self._arrived: list[tuple[BlockHash, bytes | None]] = []
        self._loading: dict[str, Request] = {}
        self._waits: dict[str, set[BlockHash]] = {}
        """The reads each loading request waits for."""
        self._held: dict[str, list[KVBlock]] = {}
        """Each loading (or loaded, not yet admitted) request's memory hits, then its loaded blocks."""
        pool.evict_listener = self._on_evict

    def _on_evict(self, block: KVBlock) -> None:
        if self._loads.pop(block.block_id, None) is not None:
            return  # loaded from disk this very step: its bytes are on disk already, and nothing read them
        if block.block_hash in self.store or not self.store.enabled:
            return
        self._spills.append((block.block_id, block.block_hash, block.token_ids))

    # --- loads: a request waits for its own blocks, the others keep running --------------------

    @property
    def loading_requests(self) -> list[Request]:
        """Requests waiting for blocks being read from disk, oldest first."""
        return list(self._loading.values())

    def is_loading(self, request: Request) -> bool:
        return request.req_id in self._loading

    def start_load(self, request: Request, num_headroom: int) -> bool:
        """Ask the reader for the blocks of the request's longest prefix hit that memory and disk hold together
        and memory alone does not, each into a fresh block reserved now (leaving ``num_headroom`` free); blocks
        another request already waits for are shared, not read twice. The hit's memory blocks are kept from
        eviction meanwhile. With a sliding window the hit needs only the blocks its window reads (the
        manager's `num_dead_blocks`): those behind it are neither read nor held. True: the request waits until
        `poll` hands it back. False: nothing to read (or it loaded once since its last admission): admit it
        with what memory has."""
        if request.req_id in self._held or not self.store.enabled:
            return False
        manager, pool, bs = self.manager, self.pool, self.block_size
        found: list[KVBlock | None] = []
        """Each prompt block's cached block in memory, or None: on disk (or being read)."""
        num_hits, last_missing = 0, -1
        candidates = request.block_hashes[:manager.max_prefix_hit_blocks(request)]
        for i, block_hash in enumerate(candidates):
            block = pool.get_cached_block(block_hash, tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
            on_disk = block_hash in self._reads or (block_hash in self.store and block_hash not in pool.cached_blocks)
            if block is None and not on_disk:
                if manager.sliding_window is None:
                    break
                last_missing = i  # a hit past this block needs only a window that starts after it
            elif last_missing < manager.num_dead_blocks((i + 1) * bs):
                num_hits = i + 1
            found.append(block)
        first = manager.num_dead_blocks(num_hits * bs)
        memory_hits = [block for block in found[first:num_hits] if block is not None]
        pool.touch(memory_hits)  # held first: a fresh block must never be one of its own hits
        waits = set()
        for i in range(first, num_hits):
            if found[i] is not None:
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self._reads:
                self._reads[block_hash].waiters.add(request.req_id)
            elif pool.num_free_blocks > num_headroom:
                block = pool.get_new_blocks(1)[0]
                tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
                self._reads[block_hash] = _Read(block, tokens, {request.req_id})
                self.store.read_async(block_hash, tokens)
            else:
                break  # no room for more: the hit ends where the reads end
            waits.add(block_hash)
        if not waits:
            pool.free_blocks(reversed(memory_hits))
            if num_hits < len(candidates) and candidates[num_hits] not in self.store:
                self.store.stats.miss_blocks += 1
            return False
        self._held[request.req_id] = memory_hits
        self._waits[request.req_id] = waits
        self._loading[request.req_id] = request
        return True

    def wait_for_reads(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a read to finish (kept for the next `poll`)."""
        self._arrived += self.store.take_reads(timeout_s)

    def poll(self) -> list[Request]:
        """Take the blocks read since the last call (each registered in the prefix cache and queued for the step's
        `kv_load`); returns the requests whose every block arrived (or failed: those are recomputed), oldest
        first. They keep holding their blocks until `release` (admitted or finished)."""
        pool = self.pool
        arrived, self._arrived = self._arrived + self.store.take_reads(), []
        for block_hash, payload in arrived:
            read = self._reads.pop(block_hash, None)
            if read is None:
                continue  # every request waiting for it left; its block went back to the pool
            if payload is not None:
                pool.set_num_tokens(read.block, self.block_size)
                pool.cache_block(read.block, block_hash, read.tokens)
            if read.block.block_hash == block_hash:
                self._loads[read.block.block_id] = payload
                for req_id in read.waiters:
                    pool.touch([read.block])
                    self._held[req_id].append(read.block)
                    self.hit_tokens += self.block_size
            pool.free_blocks([read.block])  # the reader's hold; a failed block goes back empty
            for req_id in read.waiters:
                self._waits[req_id].discard(block_hash)
        ready = [r for req_id, r in self._loading.items() if not self._waits[req_id]]
        for request in ready:
            del self._loading[request.req_id], self._waits[request.req_id]
        return ready

    def release(self, request: Request) -> None:
        """The request was admitted (its hits are its own now) or finished: drop what it held for its load,
        and stop waiting for its reads (a read nobody waits for gives its block back at once)."""
        for block_hash in self._waits.pop(request.req_id, ()):
            read = self._reads[block_hash]
            read.waiters.discard(request.req_id)
            if not read.waiters:
                del self._reads[block_hash]
                self.pool.free_blocks([read.block])
        self._loading.pop(request.req_id, None)
        self.pool.free_blocks(reversed(self._held.pop(request.req_id, [])))

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
