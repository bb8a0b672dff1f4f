"""Gang scheduling of beam groups: a group's beams compute in the same step or not at all.

The beams of a beam-search group (`Request.beam_group_id`, core/beam_selection.py) sit side by side
in `running` and in `waiting`. A group can choose its next beams only once every beam has sampled,
so the scheduler asks here, for a group at once: how many tokens each beam computes
(`beam_group_token_counts`), an upper bound on the free blocks they take (`group_block_bound`, checked
before any allocation, so a copy-on-write decided for one beam is never left pending for blocks the
group's own preemption then frees), and then the allocation itself (`allocate_running_group`,
`admit_beam_group`). Preempting to make room stays the scheduler's: a group is preempted whole
(`request_queue.take_victims`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.admission import Admission
from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol
from pagedllm.core.request import Request


def beam_group_at(queue: Sequence[Request], index: int) -> list[Request]:
    """The beams of the group whose first beam is queue[index] (a group's beams sit side by side)."""
    group_id = queue[index].beam_group_id
    end = index + 1
    while end < len(queue) and queue[end].beam_group_id == group_id:
        end += 1
    return [queue[j] for j in range(index, end)]


def beam_group_token_counts(remaining: Sequence[int], token_budget: int, admitting: bool) -> list[int] | None:
    """Tokens for each beam of a group this step, or None if the group cannot run now.

    A beam samples when it computes its last missing token, and the group can only choose its
    next beams once every beam has sampled: so either every beam finishes this step, or none
    does (each stops one token short; this only happens while a preempted group is recomputed
    in chunks). `admitting`: every beam must get a token (a beam admitted with nothing to
    compute would be unknown to the runner next step).
    """
    if sum(remaining) <= token_budget:
        return list(remaining)
    counts = [0] * len(remaining)
    budget = token_budget
    if admitting:
        if any(r < 2 for r in remaining) or budget < len(remaining):
            return None
        counts = [1] * len(remaining)
        budget -= len(remaining)
    for i, r in enumerate(remaining):
        more = min(r - 1 - counts[i], budget)
        if more > 0:
            counts[i] += more
            budget -= more
    return counts if any(counts) else None


def max_new_blocks(kv: KVCacheManagerProtocol, request: Request, num_computed: int, num_new_tokens: int) -> int:
    """An upper bound on the free blocks `request` takes to compute `num_new_tokens` more tokens
    from `num_computed` (copy-on-write of a shared partial last block counted as one)."""
    held = len(kv.get_block_ids(request.req_id))
    needed = kv.num_blocks_for_tokens(num_computed + num_new_tokens) - held
    partial_last_block = held > 0 and num_computed % kv.block_size != 0
    return max(needed, 0) + int(partial_last_block)


def group_block_bound(kv: KVCacheManagerProtocol, members: Sequence[Request], counts: Sequence[int]) -> int:
    """Free blocks the beams that compute this step (count > 0) take at most. Preempting other requests
    does not change it: it reads only the beams' own tables."""
    return sum(max_new_blocks(kv, m, m.num_computed_tokens, n) for m, n in zip(members, counts) if n)


def allocate_running_group(kv: KVCacheManagerProtocol, members: Sequence[Request],
                           counts: Sequence[int]) -> list[tuple[Request, int, list[int]]]:
    """Allocate for every running beam with a count, once `group_block_bound` fits:
    (beam, tokens, new block ids) for each."""
    entries = []
    for member, num_new in zip(members, counts):
        if num_new:
            new_block_ids = kv.allocate_slots(member, num_new)
            assert new_block_ids is not None, "the group's block bound was wrong"
            entries.append((member, num_new, new_block_ids))
    return entries


def admit_beam_group(kv: KVCacheManagerProtocol, members: Sequence[Request], token_budget: int,
                     num_headroom: int) -> list[Admission] | None:
    """Blocks for every beam of a waiting group (swapped in or recomputed), or for none (None)."""
    remaining = [m.num_tokens - m.num_computed_tokens for m in members]
    counts = beam_group_token_counts(remaining, token_budget, admitting=True)
    if counts is None or group_block_bound(kv, members, counts) + num_headroom > kv.num_free_blocks:
        return None
    # Prefix-cache hits only when every beam computes to its end; a hit would otherwise move a
    # beam's stopping point. Each beam looks up its hits just before its own allocation, so an
    # earlier beam's new blocks cannot evict them.
    use_hits = counts == remaining
    admitted = []
    for member, num_new in zip(members, counts):
        if kv.is_swapped_out(member):
            mapping = kv.swap_in(member, num_new)
            assert mapping is not None, "the group's block bound was wrong"
            admitted.append(Admission(member, num_new, member.num_computed_tokens, mapping))
            continue
        hit_blocks, num_hit_tokens = kv.get_computed_blocks(member) if use_hits else ([], 0)
        if use_hits:
            num_new = member.num_tokens - num_hit_tokens
        new_block_ids = kv.allocate_slots(member, num_new, hit_blocks)
        assert new_block_ids is not None, "the group's block bound was wrong"
        admitted.append(Admission(member, num_new, num_hit_tokens, []))
    return admitted
