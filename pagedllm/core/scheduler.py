"""The iteration-level scheduler: every step, hand out tokens from a budget.

Each request has `num_computed_tokens` and `num_tokens`; a step gives each running request
(oldest first), then each waiting one, as many of its missing tokens as the budget allows.
A prompt, a chunk of a prompt, one decode token, or a preempted request's whole history
are all the same kind of entry with different numbers.

Requests that start from another's blocks (parallel samples, beam candidates) are made by the
Forker (core/forking.py); the scheduler only places them in `running` and tells the runner.
The beams of a beam-search group (`Request.beam_group_id`, core/beam_selection.py) sit side by side
in `running` and in `waiting`, and move as one: scheduled in the same step or not at all,
preempted and readmitted together, so a group never waits on half of its beams.
Requests arrive validated against the model (InputProcessor); the scheduler refuses only what it
alone can judge: more blocks than the whole KV cache, more sequences than max_num_seqs.

The scheduling policy (core/request_queue.py) decides the order of the waiting queue and which
running request is preempted first. Under 'fcfs' that is arrival order and the newest request.
Under 'priority' `running` is kept sorted by rank (priority, arrival), so the last one is again
the first preempted and a victim is never one this step already scheduled; and a waiting request
that could not be admitted for lack of blocks preempts, at the start of the next step, the
worst-ranked running request it outranks (one per step, while it stays blocked).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.beam_selection import beam_group_token_counts, max_new_blocks, num_free_blocks
from pagedllm.core.forking import Forker
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import WaitingQueue, make_waiting_queue, priority_rank
from pagedllm.core.spec_planner import SpecDecoder
from pagedllm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.errors import InvalidRequestError

HEADROOM_BLOCKS_PER_SEQ = 2
"""Free blocks kept per running sequence when admitting. Simulated on a ShareGPT-like trace (64
requests, 300 blocks of 16): 0 -> 92 preemptions, 58% of tokens computed twice; 1 -> 60, 44%;
2 -> 33, 27%; 4 -> 20, 18% but 6% more steps (smaller batches). 2 balances the two."""


class Scheduler:
    """Admission in policy order (FCFS or priority), chunked prefill, and preemption of the newest (or, by
    priority, the worst-ranked) request when blocks run out."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 preemption_mode: str = "recompute", speculative_config: SpeculativeConfig | None = None) -> None:
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        self.preemption_mode = preemption_mode
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = make_waiting_queue(config.scheduling_policy)
        self._blocked_head: Request | None = None
        """Priority policy: the waiting head the last step could not admit for lack of blocks."""
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self.forks = Forker(kv_cache_manager)
        """Parallel samples waiting for their leader, and forks the runner has not seen yet."""
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_beam_group_preemptions = 0
        """Beam groups preempted (each whole); their beams are also counted in num_preemptions."""
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.spec = SpecDecoder(speculative_config) if speculative_config is not None else None
        """Speculative decoding (core/spec_planner.py); None when off."""

    # --- admission -------------------------------------------------------------------

    def add_request(self, request: Request, parallel_samples: list[Request] = ()) -> None:
        """Queue a request, or refuse it with InvalidRequestError if this engine could never hold it.

        The request must already be valid for the model (a non-empty prompt, prompt + max_tokens
        within max_model_len, unique ids): the front end's InputProcessor checks that. Only what
        the scheduler alone knows is checked here: max_num_seqs and the size of the KV cache.

        `parallel_samples` (n > 1) share the request's prompt: they are forked from it when its
        prompt is computed, each sampling its own first token from the same logits.
        """
        final_len = request.num_prompt_tokens + request.max_tokens
        assert 0 < request.num_prompt_tokens and final_len <= self.config.max_model_len, \
            f"{request.req_id}: the front end admitted a request that cannot fit max_model_len"
        assert all(r.req_id not in self.requests for r in [request, *parallel_samples]), \
            f"{request.req_id}: request id already in use"
        if len(parallel_samples) + 1 > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"{len(parallel_samples) + 1} parallel sequences exceed max_num_seqs ({self.config.max_num_seqs})"
            )
        num_blocks = self.kv.num_blocks_for_tokens(final_len)
        if num_blocks > self.kv.num_blocks:
            raise InvalidRequestError(
                f"this request needs up to {num_blocks} KV blocks ({final_len} tokens) but the whole "
                f"cache has {self.kv.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        for r in [request, *parallel_samples]:
            r.status = RequestStatus.WAITING
            self.requests[r.req_id] = r
        self.waiting.append(request)
        self.forks.add_samples(request, parallel_samples)

    def fork_request(self, parent_id: str, child_id: str, last_token_id: int) -> Request:
        """Start `child_id` from a running parent's computed state with a different last token (beam search).

        The parent's last token was sampled but not computed; the child replaces it with
        `last_token_id` and shares every block of the parent (copy-on-write on its first write).
        """
        assert child_id not in self.requests, f"request id {child_id!r} is already in use"
        child = self.forks.fork(self.requests[parent_id], child_id, last_token_id)
        child.priority = self.requests[parent_id].priority
        self.requests[child_id] = child
        self.running.append(child)
        return child

    def replace_beams(self, parent_ids: list[str], children: list[tuple[int, str, int]]) -> list[Request]:
        """Beam search: fork each (parent index, child id, last token) from `parent_ids[index]`, then
        finish the parents (a pruned beam's blocks are free on return). The children take the
        parents' place in `running`, so the group keeps its age and stays side by side."""
        parents = [self.requests[req_id] for req_id in parent_ids]
        kids = [self.forks.fork(parents[index], child_id, token) for index, child_id, token in children]
        for kid in kids:
            assert kid.req_id not in self.requests, f"request id {kid.req_id!r} is already in use"
            self.requests[kid.req_id] = kid
        if kids:
            position = min(self.running.index(p) for p in parents)
            self.running[position:position] = kids
        self.finish_requests(parent_ids, RequestStatus.FINISHED_ABORTED)
        return kids

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End live requests (abort, or a stop string found by the front end); frees their blocks now."""
        assert status.is_finished
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if self.forks.is_waiting_sample(request):
                pass  # in neither queue: it waits for its leader's first token
            elif request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            finished.append(request)
            finished.extend(self._free_request(request))
        return finished

    # --- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Running requests first (oldest first; by rank under 'priority'), then waiting ones."""
        token_budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        num_draft_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        if self.config.scheduling_policy == "priority":
            self._sort_running_by_rank()
        preempted: list[Request] = self._preempt_for_blocked_head()
        num_preempted_for_waiting = len(preempted)
        if self.spec is not None:
            self.spec.begin_step(len(self.running))

        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            if request.beam_group_id is not None:
                members = self._beam_group_at(self.running, i)
                entries = self._schedule_running_beams(members, token_budget, preempted)
                if entries is None:
                    break  # the group preempted itself, or waits for budget
            else:
                num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
                assert num_new > 0, f"{request.req_id} is running with nothing to compute"
                proposals, num_draft = self._propose(request, token_budget)
                num_lookahead = len(proposals) or num_draft
                new_block_ids = None
                if num_lookahead:  # speculation never preempts: without room, the request runs plainly
                    new_block_ids = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=num_lookahead)
                    if new_block_ids is not None:
                        if proposals:
                            spec_tokens[request.req_id] = proposals
                        else:
                            num_draft_tokens[request.req_id] = num_draft
                        num_new += num_lookahead
                if new_block_ids is None:
                    new_block_ids = self.kv.allocate_slots(request, num_new)
                while new_block_ids is None:
                    victims = self._preempt_newest()  # the newest request (with its beam group) goes first
                    preempted.extend(victims)
                    if victims[-1] is request:
                        break
                    new_block_ids = self.kv.allocate_slots(request, num_new)
                if new_block_ids is None:
                    break  # the request preempted itself; everything after it is gone too
                members, entries = [request], [(request, num_new, new_block_ids)]
            for member, num_new, new_block_ids in entries:
                num_scheduled[member.req_id] = num_new
                token_budget -= num_new
                if self.forks.take_unsent(member.req_id):
                    self.kv.take_replaced_blocks(member.req_id)  # the full table goes out below
                    new_reqs.append(self._new_request_data(member))
                else:
                    cached_reqs.append(
                        CachedRequestData(member.req_id, new_block_ids, member.num_computed_tokens,
                                          self.kv.take_replaced_blocks(member.req_id))
                    )
            i += len(members)

        # Admitting new work in a step that had to preempt would just preempt it again.
        if len(preempted) == num_preempted_for_waiting:
            # Headroom: admission leaves free the blocks each running sequence needs for its next
            # HEADROOM_BLOCKS_PER_SEQ * block_size tokens (capped at a quarter of the cache).
            # Without it a full batch preempts its newest request, readmits it at once, and
            # recomputes it over and over.
            max_headroom = self.kv.num_blocks // 4
            num_headroom = min(HEADROOM_BLOCKS_PER_SEQ * len(self.running), max_headroom)
            while self.waiting and token_budget > 0:
                request = self.waiting[0]
                if request.beam_group_id is not None:
                    admitted = self._admit_beams(token_budget, num_headroom)
                    if admitted is None:
                        break
                    for member, num_new in admitted:
                        num_scheduled[member.req_id] = num_new
                        token_budget -= num_new
                        new_reqs.append(self._new_request_data(member))
                    num_headroom = min(num_headroom + HEADROOM_BLOCKS_PER_SEQ * len(admitted), max_headroom)
                    continue
                if len(self.running) + 1 + len(self.forks.samples_of(request)) > self.config.max_num_seqs:
                    break
                if self.kv.is_swapped_out(request):
                    num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
                    mapping = self.kv.swap_in(request, num_new, num_headroom)
                    if mapping is None:
                        self._note_blocked(request)
                        break
                    self._swap_in.extend(mapping)
                    num_hit_tokens = request.num_computed_tokens
                else:
                    hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
                    num_new = min(request.num_tokens - num_hit_tokens, token_budget)
                    if self.kv.allocate_slots(request, num_new, hit_blocks, num_headroom) is None:
                        self._note_blocked(request)
                        break  # strict order: the head of the queue waits for blocks
                    request.num_computed_tokens = num_hit_tokens
                self.waiting.popleft()
                if request.queue_time is None:
                    request.queue_time = max(0.0, time.monotonic() - request.arrival_time)
                request.status = RequestStatus.RUNNING
                request.num_cached_tokens = num_hit_tokens
                self.running.append(request)
                num_headroom = min(num_headroom + HEADROOM_BLOCKS_PER_SEQ * (1 + len(self.forks.samples_of(request))),
                                   max_headroom)
                num_scheduled[request.req_id] = num_new
                token_budget -= num_new
                new_reqs.append(self._new_request_data(request))

        for req_id, num in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += num

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids={r.req_id for r in preempted},
            block_copies=self.kv.take_block_copies(),
            swap_out=self._swap_out,
            swap_in=self._swap_in,
            scheduled_spec_tokens=spec_tokens,
            num_draft_tokens=num_draft_tokens,
            draft_keep_up=self.spec is None or self.spec.keeps_draft_up,
        )
        self._swap_out, self._swap_in = [], []
        self._finished_req_ids = set()
        return output

    def update_from_output(
        self, sched_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests and free their blocks at once."""
        outputs: list[EngineCoreOutput] = []
        for req_id in sched_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            if req_id in runner_output.failed:
                self.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="abort", error=runner_output.failed[req_id]))
                continue
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            new_token_ids = runner_output.sampled_token_ids.get(req_id, [])
            if not new_token_ids and prompt_logprobs is None:
                continue  # a prompt chunk: nothing to tell yet
            if new_token_ids and self.forks.samples_of(request):
                self._start_parallel_samples(request, runner_output, outputs)
            accepted = []
            for token_id in new_token_ids:
                request.append_output_token(token_id)
                accepted.append(token_id)
                if self._check_stop(request):
                    break
            proposals = sched_output.scheduled_spec_tokens.get(req_id)
            if req_id in sched_output.num_draft_tokens:  # the runner's draft model made them
                proposals = runner_output.spec_token_ids[req_id]
            if proposals is not None:
                self._roll_back_rejected(request, proposals, new_token_ids)
            logprobs = runner_output.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=accepted,
                    new_logprobs=logprobs[: len(accepted)] if logprobs is not None else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_time=request.take_queue_time(),
                )
            )
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return outputs

    # --- state -----------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _check_stop(self, request: Request) -> bool:
        """Finish the request if its last token ends it. True if it finished."""
        token_id = request.output_token_ids[-1]
        params = request.sampling_params
        if request.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in request.stop_token_id_set:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # --- speculative decoding (core/spec_planner.py) --------------------------------------

    def _propose(self, request: Request, token_budget: int) -> tuple[list[int], int]:
        """(n-gram proposals, number of draft-model proposals the runner makes) for a request at
        decode; at most one of them non-empty. Never for beams, structured outputs (the runner
        verifies proposals without the grammar's mask), a prompt still computing, or past max_tokens /
        max_model_len (the accepted tokens plus the bonus must fit both)."""
        if (self.spec is None or request.beam_group_id is not None
                or request.sampling_params.structured_outputs is not None):
            return [], 0
        if request.num_tokens - request.num_computed_tokens != 1 or self.forks.samples_of(request):
            return [], 0
        max_k = min(token_budget - 1, request.max_tokens - request.num_output_tokens - 1,
                    self.config.max_model_len - request.num_tokens - 1)
        if self.spec.proposes_in_worker:
            return [], self.spec.num_to_propose(request.req_id, max_k, batch_size=len(self.running))
        return self.spec.propose(request.req_id, request.all_token_ids, max_k, batch_size=len(self.running)), 0

    def _roll_back_rejected(self, request: Request, proposals: list[int], new_token_ids: list[int]) -> None:
        """After a speculative step: the KV of the last token and of the accepted proposals stays;
        the rejected positions are uncomputed again, and blocks holding only them are freed."""
        num_accepted = len(new_token_ids) - 1
        assert 0 <= num_accepted <= len(proposals) and new_token_ids[:num_accepted] == proposals[:num_accepted]
        self.spec.record(request.req_id, len(proposals), num_accepted, len(new_token_ids))
        if request.is_finished:
            return  # its blocks are freed whole
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.trim(request, request.num_computed_tokens)

    def _new_request_data(self, request: Request) -> NewRequestData:
        """Everything the runner needs about a request it has no state for.

        num_computed_tokens is the value before this step's tokens are added.
        """
        return NewRequestData(
            req_id=request.req_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv.get_block_ids(request.req_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=request.eos_token_ids,
            fork_children=[(c.req_id, c.sampling_params) for c in self.forks.samples_of(request)],
        )

    def _start_parallel_samples(self, leader: Request, runner_output: ModelRunnerOutput,
                                outputs: list[EngineCoreOutput]) -> None:
        """The leader's prompt is computed and its samples drew their first tokens: run them."""
        for child in self.forks.fork_samples(leader, runner_output.sampled_token_ids):
            self.running.append(child)
            self._check_stop(child)
            outputs.append(EngineCoreOutput(child.req_id, list(child.output_token_ids[-1:]),
                                            new_logprobs=runner_output.logprobs.get(child.req_id),
                                            finish_reason=child.status.finish_reason,
                                            stop_reason=child.stop_reason,
                                            num_cached_tokens=leader.num_cached_tokens))
            if child.is_finished:
                self.running.remove(child)
                self._free_request(child)

    def _sort_running_by_rank(self) -> None:
        """Priority policy: best rank first, so `running.pop()` takes the worst (the newest among equals:
        the sort is stable and requests join `running` in order)."""
        self.running.sort(key=priority_rank)

    def _note_blocked(self, request: Request) -> None:
        if self.config.scheduling_policy == "priority":
            self._blocked_head = request

    def _preempt_for_blocked_head(self) -> list[Request]:
        """Priority policy: if last step's blocked head still heads the queue and outranks the worst
        running request (the last, `running` being sorted), preempt that one. Nothing of this step is
        scheduled yet, so nothing is undone. Under 'fcfs' no head is ever noted: this does nothing.

        One victim per step: the head is tried again this step with the freed blocks, and if it
        still does not fit it is noted again and the next victim goes in the next step.
        """
        head, self._blocked_head = self._blocked_head, None
        if head is None or not self.waiting or self.waiting[0] is not head or not self.running:
            return []
        if priority_rank(self.running[-1]) <= priority_rank(head):
            return []
        return self._preempt_newest()  # the worst-ranked request, with its whole beam group

    def _preempt(self, request: Request) -> None:
        """Free every device block of a running request; it goes back to the front of the queue (to its rank
        under the priority policy).

        With swapping, its KV moves to host blocks and comes back before it resumes; without
        swapping (or when the host pool is full) it is recomputed from its tokens.
        """
        mapping = self.kv.swap_out(request) if self.preemption_mode == "swap" else None
        if mapping is not None:
            self._swap_out.extend(mapping)
            self.num_swap_outs += 1
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        self.forks.take_unsent(request.req_id)  # it returns to the runner as new anyway
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # --- beam groups -----------------------------------------------------------------

    @staticmethod
    def _beam_group_at(queue, index: int) -> list[Request]:
        """The beams of the group whose first beam is queue[index] (a group's beams sit side by side)."""
        group_id = queue[index].beam_group_id
        end = index + 1
        while end < len(queue) and queue[end].beam_group_id == group_id:
            end += 1
        return [queue[j] for j in range(index, end)]

    def _preempt_newest(self) -> list[Request]:
        """Preempt the newest running request, or the whole beam group it belongs to; returns them."""
        victims = [self.running.pop()]
        group_id = victims[0].beam_group_id
        if group_id is not None:
            while self.running and self.running[-1].beam_group_id == group_id:
                victims.append(self.running.pop())
            self.num_beam_group_preemptions += 1
        for victim in victims:  # newest first: appendleft leaves the group in its order at the queue's front
            self._preempt(victim)
        return victims

    def _schedule_running_beams(self, members: list[Request], token_budget: int,
                                preempted: list[Request]) -> list[tuple[Request, int, list[int]]] | None:
        """Blocks for every running beam of a group, or none: (beam, tokens, new block ids) for the beams
        that compute this step; None if the group must wait for budget or preempted itself."""
        counts = beam_group_token_counts([m.num_tokens - m.num_computed_tokens for m in members],
                                         token_budget, admitting=False)
        if counts is None:
            return None
        # Checked for the whole group before any allocation: a copy-on-write decided for one beam
        # must never be left pending for blocks the group's own preemption then frees.
        while sum(max_new_blocks(self.kv, m, m.num_computed_tokens, n)
                  for m, n in zip(members, counts) if n) > num_free_blocks(self.kv):
            victims = self._preempt_newest()
            preempted.extend(victims)
            if any(v is members[0] for v in victims):
                return None
        entries = []
        for member, num_new in zip(members, counts):
            if num_new:
                new_block_ids = self.kv.allocate_slots(member, num_new)
                assert new_block_ids is not None, "the group's block bound was wrong"
                entries.append((member, num_new, new_block_ids))
        return entries

    def _admit_beams(self, token_budget: int, num_headroom: int) -> list[tuple[Request, int]] | None:
        """Admit every beam of the group at the head of `waiting` (swapped in or recomputed), or none.
        Returns each beam with its tokens this step; the beams are running on return."""
        members = self._beam_group_at(self.waiting, 0)
        if len(self.running) + len(members) > self.config.max_num_seqs:
            return None
        counts = beam_group_token_counts([m.num_tokens - m.num_computed_tokens for m in members],
                                         token_budget, admitting=True)
        if counts is None:
            return None
        if sum(max_new_blocks(self.kv, m, m.num_computed_tokens, n)
               for m, n in zip(members, counts)) + num_headroom > num_free_blocks(self.kv):
            return None
        # Prefix-cache hits only when every beam computes to its end; a hit would otherwise move a
        # beam's stopping point. Each beam looks up its hits just before its own allocation, so an
        # earlier beam's new blocks cannot evict them.
        use_hits = counts == [m.num_tokens - m.num_computed_tokens for m in members]
        admitted = []
        for member, num_new in zip(members, counts):
            if self.kv.is_swapped_out(member):
                mapping = self.kv.swap_in(member, num_new)
                assert mapping is not None, "the group's block bound was wrong"
                self._swap_in.extend(mapping)
                num_hit_tokens = member.num_computed_tokens
            else:
                hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(member) if use_hits else ([], 0)
                if use_hits:
                    num_new = member.num_tokens - num_hit_tokens
                assert self.kv.allocate_slots(member, num_new, hit_blocks) is not None, "the group's block bound was wrong"
                member.num_computed_tokens = num_hit_tokens
            self.waiting.popleft()
            member.status = RequestStatus.RUNNING
            member.num_cached_tokens = num_hit_tokens
            self.running.append(member)
            admitted.append((member, num_new))
        return admitted

    def _free_request(self, request: Request) -> list[Request]:
        """Release a finished request; returns what finishing it finished too (samples that never started)."""
        self.kv.free(request)
        if self.spec is not None:
            self.spec.forget(request.req_id)
        self._finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]
        orphans = self.forks.forget(request)
        return self.finish_requests([o.req_id for o in orphans], request.status) if orphans else []
