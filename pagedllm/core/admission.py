"""What goes into a step, under its two budgets: tokens, handed out request by request (`StepBuilder`, which
becomes the step's `SchedulerOutput`), and blocks, which a waiting request needs to get back in `running`.

Admission, three ways, tried in this order: a swapped-out request copies its KV back from host blocks; any
other request attaches the prefix-cache hits of its tokens and takes fresh blocks for the rest
(a preempted request recomputes its whole history this way). Either way admission leaves
`Headroom` blocks free for the running requests to grow into.

The functions here allocate and report; they never touch the queues or a request's status: the
scheduler pops the admitted requests off `waiting` and starts them (`Admission`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol
from pagedllm.core.request import Request
from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.errors import InvalidRequestError

HEADROOM_BLOCKS_PER_SEQ = 2
"""Free blocks kept per running sequence when admitting. Simulated on a ShareGPT-like trace (64
requests, 300 blocks of 16): 0 -> 92 preemptions, 58% of tokens computed twice; 1 -> 60, 44%;
2 -> 33, 27%; 4 -> 20, 18% but 6% more steps (smaller batches). 2 balances the two."""


@dataclass(slots=True)
class StepBuilder:
    """A SchedulerOutput being put together by `Scheduler.schedule`: what each request computes, from
    the step's token budget, and what the runner must be told about it."""

    token_budget: int
    """Tokens still free this step."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, req_id: str, num_tokens: int) -> None:
        """`req_id` computes `num_tokens` this step (its proposals' slots included)."""
        self.num_scheduled_tokens[req_id] = num_tokens
        self.token_budget -= num_tokens

    def build(self, **fields) -> SchedulerOutput:
        """The output; `fields`: the rest of SchedulerOutput (preemptions, copies, swaps, ...)."""
        return SchedulerOutput(self.new_reqs, self.cached_reqs, self.num_scheduled_tokens,
                               sum(self.num_scheduled_tokens.values()), scheduled_spec_tokens=self.scheduled_spec_tokens,
                               num_draft_tokens=self.num_draft_tokens, **fields)


def refuse_if_never_fits(config: SchedulerConfig, kv: KVCacheManagerProtocol, request: Request,
                         num_sequences: int) -> None:
    """InvalidRequestError if this engine could never run `request` with its `num_sequences` parallel
    sequences: more than max_num_seqs, or more blocks than the whole KV cache at its largest (its final
    length, or with blocks freed behind a sliding window, its window and one step's tokens)."""
    if num_sequences > config.max_num_seqs:
        raise InvalidRequestError(f"{num_sequences} parallel sequences exceed max_num_seqs ({config.max_num_seqs})")
    final_len = request.num_prompt_tokens + request.max_tokens
    num_blocks = kv.max_blocks_held(final_len, config.max_num_batched_tokens)
    if num_blocks > kv.num_blocks:
        raise InvalidRequestError(
            f"this request needs up to {num_blocks} KV blocks ({final_len} tokens) but the whole "
            f"cache has {kv.num_blocks}; raise kv_cache_memory or lower max_tokens"
        )


class Headroom:
    """The free blocks admission leaves for running sequences to grow into: HEADROOM_BLOCKS_PER_SEQ
    per sequence, capped at a quarter of the cache. Without it a full batch preempts its newest
    request, readmits it at once, and recomputes it over and over."""

    def __init__(self, num_kv_blocks: int, num_running: int) -> None:
        self.max_num_blocks = num_kv_blocks // 4
        self.num_blocks = min(HEADROOM_BLOCKS_PER_SEQ * num_running, self.max_num_blocks)

    def add_sequences(self, num_sequences: int) -> None:
        """Sequences just admitted will grow too."""
        self.num_blocks = min(self.num_blocks + HEADROOM_BLOCKS_PER_SEQ * num_sequences, self.max_num_blocks)


class Admission(NamedTuple):
    """One request admitted this step, its blocks allocated."""

    request: Request
    num_new_tokens: int
    """Tokens it computes this step."""
    num_computed_tokens: int
    """Its computed tokens once admitted: prefix-cache hits, or what came back from host blocks."""
    swap_in: list[tuple[int, int]]
    """(host block, device block) copies the runner makes before the step (empty unless swapped out)."""


def admit_request(kv: KVCacheManagerProtocol, request: Request, token_budget: int,
                  num_headroom: int) -> Admission | None:
    """Blocks for up to `token_budget` of the request's missing tokens, leaving `num_headroom` free;
    None (nothing changed) if they do not fit."""
    if kv.is_swapped_out(request):
        num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
        mapping = kv.swap_in(request, num_new, num_headroom)
        return None if mapping is None else Admission(request, num_new, request.num_computed_tokens, mapping)
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
    num_new = min(request.num_tokens - num_hit_tokens, token_budget)
    if kv.allocate_slots(request, num_new, hit_blocks, num_headroom) is None:
        return None
    return Admission(request, num_new, num_hit_tokens, [])
