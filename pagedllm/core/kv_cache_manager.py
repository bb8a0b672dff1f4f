"""Per-request block tables on top of the block pool.

A request holds the blocks covering its computed and scheduled tokens, no more: a new
block is taken only in the step the request first writes past its last block.

    block_size = 4, 10 tokens computed or scheduled:
    block table:  [ 7 | 2 | 9 ]
                   ####  ####  ##..     '#' slot holds KV, '.' slot free for the next tokens

With a sliding window W on every layer, a query at position p reads keys p - W + 1 .. p only, so
once `num_computed_tokens` (the first position a step computes) passes a block's last position by
W, no step reads it again: it goes back to the pool and its table entry points at the null block,
a reserved id (the last) that is never handed out, never written, and never read by the compiled
op (it starts at the window); the torch reference gathers it as zeros and masks it.

    W = 6, block_size = 4, 13 tokens computed (the next query, at 13, reads keys 8..13):
    block table:  [ N | N | 9 | 4 ]     N: null, its block freed (still findable by its prefix hash)
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.block_hash import extend_block_hashes, prefix_extra_keys
from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.host_swap import NULL_ENTRY, HostSwapSpace
from pagedllm.core.kv_stats import KVCacheStats
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        """The window every attention layer shares (None: some layer reads the whole context, nothing is freed)."""
        self.null_block: KVBlock | None = None
        if sliding_window is not None:
            if sliding_window < 1 or num_blocks < 2:
                raise ValueError(f"a sliding window needs window >= 1 and 2+ blocks, got {sliding_window}, {num_blocks}")
            num_blocks -= 1  # the last id is the null block: in no table's live part, outside the pool
            self.null_block = KVBlock(block_id=num_blocks)
        self._num_null: dict[str, int] = {}
        """Leading null entries of each windowed table (blocks released out of the window)."""
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache."""
        self.prefix_cache_hits = 0
        """Of those, tokens served from cached blocks."""
        self.num_cow_copies = 0
        # Copy-on-write results, drained by the scheduler into the step's output.
        self._pending_copies: list[tuple[int, int]] = []
        self._replaced: dict[str, dict[int, int]] = {}
        self.host = HostSwapSpace(num_host_blocks)
        """Swap space: host blocks holding preempted requests' KV (core/host_swap.py)."""
        self.num_refs_by_priority: dict[int, int] = {}
        """Block-table entries by request priority, kept as tables grow and shrink (see kv_stats)."""

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks free or holding only evictable cached KV: what an allocation can take now."""
        return self.pool.num_free_blocks

    @property
    def num_host_blocks(self) -> int:
        """Swap space, in blocks (0: preemption recomputes)."""
        return self.host.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """A step writing C slots from n holds positions n - W + 1 .. n + C - 1: ceil((W - 1 + C) / bs) + 1 blocks."""
        if self.sliding_window is None:
            return self.num_blocks_for_tokens(num_tokens)
        return min(self.num_blocks_for_tokens(num_tokens), cdiv(self.sliding_window - 1 + max_step_tokens,
                                                                self.block_size) + 1)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The cached blocks of the request's longest cached prefix, and how many tokens they hold.

        The last token is never counted as cached: it must be computed so its logits exist.
        """
        if not self._caches_prefix(request):
            return [], 0  # prompt logprobs (and most pooling) need every prompt position computed
        max_hit_blocks = self.max_prefix_hit_blocks(request)
        found: list[KVBlock | None] = []
        num_hits = run_start = 0  # run_start: the first block of the run of cached blocks ending at i
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            tokens = tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.get_cached_block(block_hash, tokens)
            found.append(block)
            if block is None:
                if self.sliding_window is None:
                    break
                run_start = i + 1  # a window past this block may still hit
            elif run_start <= self.num_dead_blocks((i + 1) * self.block_size):
                num_hits = i + 1  # every block the next query's window reads is cached
        num_dead = self.num_dead_blocks(num_hits * self.block_size)
        hits = [self.null_block] * num_dead + found[num_dead:num_hits]
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hits * self.block_size
        return hits, num_hits * self.block_size

    def max_prefix_hit_blocks(self, request: Request) -> int:
        """Blocks a prefix hit may cover (the last token is computed, for its logits); its block hashes updated
        that far (the disk tier looks them up)."""
        if not self._caches_prefix(request):
            return 0
        self._update_block_hashes(request)
        return (request.num_tokens - 1) // self.block_size

    def _caches_prefix(self, request: Request) -> bool:
        return self.enable_caching and request.sampling_params.prompt_logprobs is None and not (
            request.pooling_params is not None and request.pooling_params.needs_every_position)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_headroom_blocks: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`; None if they do not fit.

        `new_computed_blocks` are prefix-cache hits being attached at admission; they come
        before any new block in the table. `num_headroom_blocks` must stay free afterwards
        (None otherwise). `num_lookahead_tokens` more slots follow for speculative proposals:
        they are not the request's tokens, so no block they reach is registered in the prefix
        cache (see `trim` for their rollback). Returns the ids appended to the block table.
        """
        held = self.req_to_blocks.get(request.req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        if self.null_block is not None and held:
            # Before the fit check, so the blocks freed count. Only by num_computed_tokens as scheduled:
            # a speculative rollback never moves it back past that, so nothing freed is read again.
            self._release_out_of_window(request, held, num_computed)
        num_needed = self.num_blocks_for_tokens(num_computed + num_new_tokens + num_lookahead_tokens)
        num_new_blocks = max(0, num_needed - len(held) - len(new_computed_blocks))
        # The first new token lands in a partially filled last block that others share:
        # this request gets a private copy first. The last sharer writes in place.
        needs_cow = bool(held) and num_computed % self.block_size != 0 and held[-1].ref_cnt > 1
        # A cache hit sitting in the free queue stops being available once we take it.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and block is not self.null_block)
        if num_new_blocks + needs_cow + num_headroom_blocks > self.pool.num_free_blocks - num_free_hits:
            return None

        if needs_cow:
            self._copy_on_write(request.req_id, held)
        num_null_hits = 0
        if new_computed_blocks and new_computed_blocks[0] is self.null_block:  # hits behind the window
            assert not held, "prefix hits are attached at admission only"
            num_null_hits = new_computed_blocks.count(self.null_block)
            self._num_null[request.req_id] = num_null_hits
        self.pool.touch(new_computed_blocks[num_null_hits:])
        new_blocks = list(new_computed_blocks) + self.pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(request.req_id, [])
        blocks.extend(new_blocks)
        if len(new_blocks) > num_null_hits:
            self._count_refs(request, len(new_blocks) - num_null_hits)
        # Proposals' slots are written this step too; a rollback (`trim`) unfills the rejected ones.
        self.pool.fill_table(blocks, num_computed // self.block_size,
                             num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return [block.block_id for block in new_blocks]

    def trim(self, request: Request, num_tokens: int) -> int:
        """Speculative rollback: free the tail blocks that hold none of the first `num_tokens` slots.

        The freed blocks were new this step and private (proposals only ever write past the last
        computed token, into a private or copied block), never registered in the prefix cache.
        Returns the length of the request's block table afterwards (the runner cuts its copy to it).
        """
        blocks = self.req_to_blocks.get(request.req_id)
        if not blocks:
            return 0
        num_keep = self.num_blocks_for_tokens(num_tokens)
        self.pool.unfill_after_rollback(blocks[:num_keep], num_tokens, self.block_size)
        tail = blocks[num_keep:]
        if not tail:
            return len(blocks)
        assert num_keep >= self._num_cached_blocks.get(request.req_id, 0), "rolled back into a cached block"
        assert all(block.ref_cnt == 1 for block in tail), "a rolled-back block is shared"
        del blocks[num_keep:]
        self._count_refs(request, -len(tail))
        self.pool.free_blocks(reversed(tail))
        return num_keep

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block table: every block shared, ref counts up, nothing copied.

        The child's tokens must agree with the parent's on every computed position.
        """
        assert child.req_id not in self.req_to_blocks, f"{child.req_id} already holds blocks"
        blocks = list(self.req_to_blocks.get(parent.req_id, []))
        num_null = self._num_null.get(parent.req_id, 0)  # null entries are shared harmlessly: nobody owns them
        if num_null:
            self._num_null[child.req_id] = num_null
        self.pool.touch(blocks[num_null:])
        self.req_to_blocks[child.req_id] = blocks
        self._count_refs(child, len(blocks) - num_null)
        num_common_blocks = child.num_computed_tokens // self.block_size
        self._num_cached_blocks[child.req_id] = min(self._num_cached_blocks.get(parent.req_id, 0), num_common_blocks)
        child.block_hashes = parent.block_hashes[:num_common_blocks]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies decided since the last call; the runner applies them before the forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_replaced_blocks(self, req_id: str) -> dict[int, int]:
        """Block-table entries of `req_id` replaced by copy-on-write since the last call: index -> new block id."""
        return self._replaced.pop(req_id, {})

    def forget_replaced_blocks(self, req_id: str) -> None:
        """Drop the record of `req_id`'s replaced entries: its whole table goes to the runner (a new or resumed
        request), so there is nothing to patch."""
        self._replaced.pop(req_id, None)

    def _copy_on_write(self, req_id: str, blocks: list[KVBlock]) -> None:
        shared = blocks[-1]
        (private,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([shared])
        blocks[-1] = private
        self._pending_copies.append((shared.block_id, private.block_id))
        self._replaced.setdefault(req_id, {})[len(blocks) - 1] = private.block_id
        self.num_cow_copies += 1

    # --- swapping -----------------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move a request's KV to host blocks; None (nothing changed) if the host pool cannot hold it.

        Returns the (device block, host block) copies to make before the device blocks are reused.
        The device blocks are freed (shared ones only lose this request's reference).
        """
        blocks = self.req_to_blocks.get(request.req_id, [])
        num_null = self._num_null.get(request.req_id, 0)  # the null block is not swapped
        if not self.host.fits(len(blocks) - num_null):
            return None
        host_blocks = self.host.take(request.req_id, num_null, len(blocks) - num_null)
        mapping = [(block.block_id, host) for block, host in zip(blocks[num_null:], host_blocks[num_null:])]
        self.free(request, keep_host_blocks=True)
        return mapping

    def is_swapped_out(self, request: Request) -> bool:
        return request.req_id in self.host.tables

    def swap_in(self, request: Request, num_new_tokens: int,
                num_headroom_blocks: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back into fresh device blocks, plus room for `num_new_tokens`.

        Returns the (host block, device block) copies, or None (nothing changed) if it does not
        fit while leaving `num_headroom_blocks` free.
        """
        host_blocks = self.host.tables[request.req_id]
        num_null = host_blocks.count(NULL_ENTRY)
        num_needed = self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - num_null
        if num_needed + num_headroom_blocks > self.pool.num_free_blocks:
            return None
        device_blocks = self.pool.get_new_blocks(len(host_blocks) - num_null)
        table = [self.null_block] * num_null + device_blocks
        self.req_to_blocks[request.req_id] = table
        if num_null:
            self._num_null[request.req_id] = num_null
        self._count_refs(request, len(device_blocks))
        self.pool.fill_table(table, num_null, request.num_computed_tokens, self.block_size)
        mapping = [(host, block.block_id) for host, block in zip(host_blocks[num_null:], device_blocks)]
        self.host.release(request.req_id)
        assert self.allocate_slots(request, num_new_tokens) is not None
        return mapping

    def free(self, request: Request, keep_host_blocks: bool = False) -> None:
        """Release every block of the request, tail first so its tail is evicted before shared heads."""
        if not keep_host_blocks and request.req_id in self.host.tables:
            self.host.release(request.req_id)
        blocks = self.req_to_blocks.pop(request.req_id, [])[self._num_null.pop(request.req_id, 0):]
        self._num_cached_blocks.pop(request.req_id, None)
        self._replaced.pop(request.req_id, None)
        self._count_refs(request, -len(blocks))
        self.pool.free_blocks(reversed(blocks))

    # --- sliding window -------------------------------------------------------------------

    def num_dead_blocks(self, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on reads: all their positions are below
        num_computed - W + 1 (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _release_out_of_window(self, request: Request, blocks: list[KVBlock], num_computed: int) -> None:
        """Free the blocks that fell out of the window; their entries become the null block (the runner
        is told through the replaced entries, as for copy-on-write). Oldest first: evicted first."""
        req_id = request.req_id
        first = self._num_null.get(req_id, 0)
        num_dead = min(self.num_dead_blocks(num_computed), len(blocks))
        if num_dead <= first:
            return
        dead = blocks[first:num_dead]
        blocks[first:num_dead] = [self.null_block] * len(dead)
        replaced = self._replaced.setdefault(req_id, {})
        for i in range(first, num_dead):
            replaced[i] = self.null_block.block_id
        self._num_null[req_id] = num_dead
        self._count_refs(request, -len(dead))
        self.pool.free_blocks(dead)

    def num_live_blocks(self, req_id: str) -> int:
        """Blocks the request holds: its table less the null entries (for gauges and tests)."""
        return len(self.req_to_blocks.get(req_id, ())) - self._num_null.get(req_id, 0)

    # --- gauges ---------------------------------------------------------------------------

    def kv_stats(self) -> KVCacheStats:
        """The KV cache's occupancy now, from counters (O(number of priorities), no scan)."""
        pool = self.pool
        num_used = pool.num_blocks - pool.num_free_blocks
        return KVCacheStats(
            num_blocks=pool.num_blocks, block_size=self.block_size, num_used_blocks=num_used,
            num_cached_blocks=pool.num_cached_free_blocks,
            num_empty_blocks=pool.num_free_blocks - pool.num_cached_free_blocks,
            num_filled_slots=pool.num_filled_slots, num_shared_blocks=pool.num_shared_blocks,
            num_block_refs=pool.num_block_refs, num_allocated_slots=num_used * self.block_size,
            num_saved_blocks=pool.num_block_refs - num_used, num_host_blocks=self.host.num_blocks,
            num_swapped_blocks=self.host.num_used_blocks, blocks_by_priority=dict(self.num_refs_by_priority))

    def block_states(self) -> tuple[list[int], list[int], list[int]]:
        """Every block's ref_cnt and the slots holding KV (index = block id; a cached free block holds a full
        block's), and the free blocks still holding a cached prefix: a full walk of the pool, for a picture of
        it (the dashboard), not for gauges."""
        return self.pool.block_states()

    def _count_refs(self, request: Request, delta: int) -> None:
        if not delta:
            return
        num = self.num_refs_by_priority.get(request.priority, 0) + delta
        if num:
            self.num_refs_by_priority[request.priority] = num
        else:
            del self.num_refs_by_priority[request.priority]

    def _update_block_hashes(self, request: Request) -> None:
        lora = request.lora_request
        extra_keys = prefix_extra_keys(request.cache_salt, lora.cache_key if lora is not None else None)
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, extra_keys)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Register the blocks that `num_tokens` fills completely under their chain hashes."""
        num_full = num_tokens // self.block_size
        first = self._num_cached_blocks.get(request.req_id, 0)
        if num_full <= first:
            return
        self._update_block_hashes(request)
        bs = self.block_size
        for i in range(max(first, self._num_null.get(request.req_id, 0)), num_full):
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(blocks[i], request.block_hashes[i], tokens)
        self._num_cached_blocks[request.req_id] = num_full

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_no_leaks(self) -> list[str]:
        """With no request alive, every block must be free. Returns what is wrong (empty = fine)."""
        problems = []
        if self.req_to_blocks:
            problems.append(f"requests still hold blocks: {sorted(self.req_to_blocks)}")
        held = [b.block_id for b in self.pool.blocks if b.ref_cnt != 0]
        if held:
            problems.append(f"blocks with nonzero ref_cnt: {held[:20]}")
        if self.pool.num_free_blocks != self.pool.num_blocks:
            problems.append(f"{self.pool.num_blocks - self.pool.num_free_blocks} blocks missing from the free queue")
        return problems + (self.host.problems() if self.host.tables or self.host.num_used_blocks else [])
