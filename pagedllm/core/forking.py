"""Forks: requests that start from another request's computed state, sharing its KV blocks.

Two kinds, both copy-on-write through the KV cache manager's `fork` (ref counts up, nothing copied):

- Parallel samples (n > 1 / best_of). The samples of a request wait, unscheduled, while its
  first sequence (the leader) computes the prompt once. In the step the leader samples its first
  token, each sample draws its own first token from the same logits (the runner is told through
  `NewRequestData.fork_children`), takes the leader's block table and starts running.
- Beam candidates. A running beam whose last sampled token is not yet computed is forked with
  a different last token (`fork`).

A forked request is new to the runner: the scheduler sends its whole state once (`take_unsent`).
The scheduler owns `requests` and `running`; this class only decides what a fork looks like. The scheduler
reads `samples`, `leader_of` and `unsent` itself, so a request that forks nothing costs no call here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol
from pagedllm.core.request import Request, RequestStatus


class Forker:
    """Tracks the samples waiting for their leader and the forks the runner has not seen yet."""

    def __init__(self, kv: KVCacheManagerProtocol) -> None:
        self.kv = kv
        self.samples: dict[str, list[Request]] = {}
        """Leader req_id -> its samples not forked yet, in sequence order (only leaders that have some)."""
        self.leader_of: dict[str, Request] = {}
        """Sample req_id -> the leader it waits for: a sample here is in neither queue."""
        self.unsent: set[str] = set()
        """Forked requests the runner has not been told about yet."""

    # --- parallel samples ----------------------------------------------------------------

    def add_samples(self, leader: Request, samples: Iterable[Request]) -> None:
        """Make `samples` wait for `leader`'s first sampled token."""
        samples = list(samples)
        if samples:
            self.samples[leader.req_id] = samples
            for sample in samples:
                self.leader_of[sample.req_id] = leader

    def samples_of(self, leader: Request) -> list[Request]:
        """The samples still waiting for `leader` (empty for most requests)."""
        return self.samples.get(leader.req_id, [])

    def is_waiting_sample(self, request: Request) -> bool:
        """True while `request` is a sample waiting for its leader (neither waiting nor running)."""
        return request.req_id in self.leader_of

    def fork_samples(self, leader: Request, sampled_token_ids: Mapping[str, list[int]]) -> list[Request]:
        """Fork every waiting sample of `leader` that drew a token this step; returns them, running.

        Call before the leader's own new token is appended: a sample copies the leader's tokens
        (the prompt, plus any output kept over a preemption), then appends its own first token.
        """
        forked = []
        for sample in list(self.samples_of(leader)):
            token_ids = sampled_token_ids.get(sample.req_id)
            if not token_ids:
                continue
            self._detach_sample(sample)
            sample.all_token_ids = list(leader.all_token_ids)
            sample.output_token_ids = list(leader.output_token_ids)
            self._start(leader, sample)
            sample.append_output_token(token_ids[0])
            forked.append(sample)
        return forked

    # --- beam candidates -----------------------------------------------------------------

    def fork(self, parent: Request, child_id: str, last_token_id: int) -> Request:
        """A new running request: `parent` with its last (sampled, not yet computed) token replaced.

        The child shares every block of the parent (the first write into a shared partial block
        copies it) and its rank: its priority and arrival time.
        """
        assert parent.status == RequestStatus.RUNNING and parent.num_computed_tokens == parent.num_tokens - 1
        child = Request(child_id, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_ids,
                        parent.max_tokens, parent.arrival_time, parent.cache_salt, parent.priority, parent.lora_request,
                        stop_token_id_set=parent.stop_token_id_set, beam_group_id=parent.beam_group_id)
        child.output_token_ids = parent.output_token_ids[:-1] + [last_token_id]
        child.all_token_ids = child.prompt_token_ids + child.output_token_ids
        self._start(parent, child)
        return child

    # --- bookkeeping ---------------------------------------------------------------------

    def take_unsent(self, req_id: str) -> bool:
        """True (once) if `req_id` was forked since the runner last heard of it."""
        if req_id in self.unsent:
            self.unsent.discard(req_id)
            return True
        return False

    def forget(self, request: Request) -> list[Request]:
        """Drop every trace of a finished request; returns its samples that can never start now.

        The caller must finish those too (until then they still count as waiting samples).
        """
        self.unsent.discard(request.req_id)
        if self.is_waiting_sample(request):
            self._detach_sample(request)
        return self.samples.pop(request.req_id, [])

    def _start(self, parent: Request, child: Request) -> None:
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        self.unsent.add(child.req_id)

    def _detach_sample(self, sample: Request) -> None:
        leader = self.leader_of.pop(sample.req_id)
        samples = self.samples.get(leader.req_id)
        if samples is None:
            return  # the leader finished first: `forget` handed this sample out as an orphan
        samples.remove(sample)
        if not samples:
            del self.samples[leader.req_id]


def kv_block_usage(kv: KVCacheManagerProtocol, req_ids: Iterable[str]) -> tuple[int, int]:
    """(distinct blocks the requests hold, sum of their block-table lengths): what sharing saves."""
    held: set[int] = set()
    num_unshared = 0
    for req_id in req_ids:
        block_ids = kv.get_block_ids(req_id)
        held.update(block_ids)
        num_unshared += len(block_ids)
    return len(held), num_unshared
