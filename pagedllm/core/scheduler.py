"""The iteration-level scheduler: every step, hand out tokens from a budget.

Each request has `num_computed_tokens` and `num_tokens`; a step gives each running request
(oldest first), then each waiting one, as many of its missing tokens as the budget allows.
A prompt, a chunk of a prompt, one decode token, or a preempted request's whole history
are all the same kind of entry with different numbers. When blocks run out, the newest running
request is preempted (recomputed later, or swapped out) until the one being scheduled fits.

The rest it asks of collaborators, which answer and never call back:

    request_queue      core/request_queue.py  the waiting queue, the victims; under 'priority' the order of `running`
    admit_request      core/admission.py      blocks for a waiting request (prefix hits, swap-in), headroom; StepBuilder
    beam_gang          core/beam_gang.py      a beam group's beams scheduled as one, or not at all
    SpecDecoder        core/spec_planner.py   speculative proposals: plan before the step, settle after
    Forker             core/forking.py        parallel samples and beam candidates sharing blocks
    LoRASlotLimit      core/lora_admission.py at most max_loras distinct adapters running (the head waits)
    DiskTier           core/kv_disk_tier.py   a prefix read from disk: its request waits aside, the rest run
    KV cache manager   core/kv_cache_interface.py  blocks, through KVCacheManagerProtocol only
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.admission import Admission, Headroom, StepBuilder, admit_request, refuse_if_never_fits
from pagedllm.core.beam_gang import (admit_beam_group, allocate_running_group, beam_group_at,
                                     beam_group_token_counts, group_block_bound)
from pagedllm.core.forking import Forker
from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol
from pagedllm.core.kv_disk_tier import DiskTier
from pagedllm.core.lora_admission import LoRASlotLimit
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import PriorityPolicy, WaitingQueue, make_waiting_queue, take_victims
from pagedllm.core.sched_output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                        SchedulerOutput)
from pagedllm.core.spec_planner import SpecDecoder

Scheduled = tuple[Request, int, list[int]]  # (request, tokens this step, block ids appended to its table)


class Scheduler:
    """Admission in policy order (FCFS or priority), chunked prefill, and preemption of the newest (or, by
    priority, the worst-ranked) request when blocks run out."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManagerProtocol,
                 preemption_mode: str = "recompute", speculative_config: SpeculativeConfig | None = None,
                 max_loras: int | None = None, disk_tier: DiskTier | None = None) -> None:
        self.preemption_mode = preemption_mode
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.priority = PriorityPolicy() if config.scheduling_policy == "priority" else None  # None: FCFS
        self.waiting: WaitingQueue = make_waiting_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self.forks = Forker(kv_cache_manager)
        """Parallel samples waiting for their leader, and forks the runner has not seen yet."""
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_beam_group_preemptions = 0  # each whole; their beams are also counted in num_preemptions
        self._swap_out, self._swap_in = [], []  # (src, dst) block copies for this step's output
        self._num_kept_block_ids: dict[str, int] = {}
        """Speculative rollback: req_id -> its table's length after `kv.trim`, sent once in its next CachedRequestData."""
        self.spec = SpecDecoder(speculative_config) if speculative_config is not None else None  # None: off
        self.lora_limit = LoRASlotLimit(max_loras) if max_loras is not None else None  # None: LoRA off
        self.disk = disk_tier
        """Prefix blocks on disk (None: memory only); requests waiting for their reads are held there."""

    # --- admission -------------------------------------------------------------------

    def add_request(self, request: Request, parallel_samples: list[Request] = ()) -> None:
        """Queue a request, or refuse it with InvalidRequestError if this engine could never hold it.

        The request must already be valid for the model (a non-empty prompt, prompt + max_tokens
        within max_model_len, unique ids): the front end's InputProcessor checks that. Only what
        the scheduler alone knows is checked here: max_num_seqs and the size of the KV cache.

        `parallel_samples` (n > 1) share the request's prompt: they are forked from it when its
        prompt is computed, each sampling its own first token from the same logits.
        """
        assert 0 < request.num_prompt_tokens and request.num_prompt_tokens + request.max_tokens <= \
            self.config.max_model_len, f"{request.req_id}: the front end admitted a request that cannot fit max_model_len"
        assert all(r.req_id not in self.requests for r in [request, *parallel_samples]), \
            f"{request.req_id}: request id already in use"
        refuse_if_never_fits(self.config, self.kv, request, num_sequences=1 + len(parallel_samples))
        for r in [request, *parallel_samples]:
            r.status = RequestStatus.WAITING
            self.requests[r.req_id] = r
        self.waiting.append(request)
        if parallel_samples:
            self.forks.add_samples(request, parallel_samples)

    def fork_request(self, parent_id: str, child_id: str, last_token_id: int) -> Request:
        """Start `child_id` from a running parent whose last token was sampled, not computed, with
        `last_token_id` in its place; it shares every block of the parent (copy-on-write on its first write)."""
        assert child_id not in self.requests, f"request id {child_id!r} is already in use"
        child = self.forks.fork(self.requests[parent_id], child_id, last_token_id)
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
            if request.req_id in self.forks.leader_of:
                pass  # in neither queue: it waits for its leader's first token
            elif request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif self.disk is None or not self.disk.is_loading(request):
                self.waiting.remove(request)
            request.status = status
            finished.append(request)
            finished.extend(self._free_request(request))
        return finished

    # --- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Running requests first (oldest first; by rank under 'priority'), then waiting ones."""
        step = StepBuilder(self.config.max_num_batched_tokens)
        if self.disk is not None:  # requests whose blocks were all read go back to the queue's front
            for request in reversed(self.disk.poll()):
                self.waiting.appendleft(request)
        preempted = []
        if self.priority is not None:  # FCFS keeps `running` in arrival order, and its waiting head never preempts
            self.priority.order_running(self.running)
            if self.priority.preempts_for_blocked_head(self.waiting, self.running):
                preempted = self._preempt_newest()
        num_preempted_for_waiting = len(preempted)
        if self.spec is not None:
            self.spec.begin_step(len(self.running))

        i = 0
        while i < len(self.running) and step.token_budget > 0:
            if self.running[i].beam_group_id is not None:
                members = beam_group_at(self.running, i)
                entries = self._schedule_running_group(members, step.token_budget, preempted)
            else:
                members = [self.running[i]]
                entries = self._schedule_running_request(members[0], step, preempted)
            if entries is None:
                break  # it preempted itself (everything after it is gone too), or a group waits for budget
            for member, num_new, new_block_ids in entries:
                step.add(member.req_id, num_new)
                if self.forks.unsent and self.forks.take_unsent(member.req_id):
                    step.new_reqs.append(self._new_request_data(member))
                else:
                    step.cached_reqs.append(CachedRequestData(
                        member.req_id, new_block_ids, member.num_computed_tokens,
                        self.kv.take_replaced_blocks(member.req_id), self._num_kept_block_ids.pop(member.req_id, None)))
            i += len(members)

        # Admitting new work in a step that had to preempt would just preempt it again.
        headroom = Headroom(self.kv.num_blocks, len(self.running))
        while len(preempted) == num_preempted_for_waiting and self.waiting and step.token_budget > 0:
            head = self.waiting[0]
            members = [head] if head.beam_group_id is None else beam_group_at(self.waiting, 0)
            num_seqs = len(members) + len(self.forks.samples.get(head.req_id, ()))
            if len(self.running) + num_seqs > self.config.max_num_seqs:
                break
            if self.lora_limit is not None and not self.lora_limit.admits(head, self.running):
                break  # strict order: the head waits for an adapter slot, nobody overtakes it
            if self.disk is not None and head.beam_group_id is None and not self.kv.is_swapped_out(head) and \
                    self.disk.start_load(head, headroom.num_blocks):
                self.waiting.popleft()  # aside until its blocks are read; the next one may start meanwhile
                continue
            if head.beam_group_id is not None:
                admitted = admit_beam_group(self.kv, members, step.token_budget, headroom.num_blocks)
            else:
                admission = admit_request(self.kv, head, step.token_budget, headroom.num_blocks)
                admitted = None if admission is None else [admission]
                if admission is None and self.priority is not None:
                    self.priority.note_blocked(head)
            if admitted is None:
                break  # strict order: the head of the queue waits for blocks
            for admission in admitted:
                self._start_running(admission)
                if self.disk is not None:
                    self.disk.release(admission.request)  # its hits are held by its own table now
                step.add(admission.request.req_id, admission.num_new_tokens)
                step.new_reqs.append(self._new_request_data(admission.request))
            headroom.add_sequences(num_seqs)

        for req_id, num in step.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num
        output = step.build(finished_req_ids=self._finished_req_ids, preempted_req_ids={r.req_id for r in preempted},
                            block_copies=self.kv.take_block_copies(), swap_out=self._swap_out, swap_in=self._swap_in,
                            draft_keep_up=self.spec is None or self.spec.keeps_draft_up)
        self._swap_out, self._swap_in, self._finished_req_ids = [], [], set()
        return output

    def _schedule_running_request(self, request: Request, step: StepBuilder,
                                  preempted: list[Request]) -> list[Scheduled] | None:
        """Blocks for a running request's next tokens (and its proposals, if they fit), preempting the
        newest requests until they fit; None if it had to preempt itself."""
        num_new = min(request.num_tokens - request.num_computed_tokens, step.token_budget)
        assert num_new > 0, f"{request.req_id} is running with nothing to compute"
        new_block_ids = None
        if self.spec is not None:
            plan = self.spec.plan(request, step.token_budget, len(self.running), self.config.max_model_len,
                                  request.req_id in self.forks.samples)
            new_block_ids = self.spec.allocate(self.kv, request, num_new, plan, step)
            num_new += plan.num_lookahead_tokens if new_block_ids is not None else 0
        while new_block_ids is None:
            new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                victims = self._preempt_newest()  # the newest request (with its beam group) goes first
                preempted.extend(victims)
                if victims[-1] is request:
                    return None
        return [(request, num_new, new_block_ids)]

    def _schedule_running_group(self, members: list[Request], token_budget: int,
                                preempted: list[Request]) -> list[Scheduled] | None:
        """Blocks for every running beam of a group, or none (core/beam_gang.py); None if the group waits
        for budget or preempted itself."""
        counts = beam_group_token_counts([m.num_tokens - m.num_computed_tokens for m in members],
                                         token_budget, admitting=False)
        if counts is None:
            return None
        num_blocks_needed = group_block_bound(self.kv, members, counts)
        while num_blocks_needed > self.kv.num_free_blocks:
            victims = self._preempt_newest()
            preempted.extend(victims)
            if any(v is members[0] for v in victims):
                return None
        return allocate_running_group(self.kv, members, counts)

    def _start_running(self, admission: Admission) -> None:
        """Move an admitted request from the head of `waiting` to the end of `running`."""
        request = admission.request
        head = self.waiting.popleft()
        assert head is request, "admitted out of queue order"
        self._swap_in.extend(admission.swap_in)
        request.num_computed_tokens = request.num_cached_tokens = admission.num_computed_tokens
        if request.queue_time is None:
            request.queue_time = max(0.0, time.monotonic() - request.arrival_time)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def update_from_output(self, sched_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
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
            if request.pooling_params is not None:
                self._finish_pooled(request, runner_output.pooled.get(req_id), outputs)
                continue
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            new_token_ids = runner_output.sampled_token_ids.get(req_id, [])
            if not new_token_ids and prompt_logprobs is None:
                continue  # a prompt chunk: nothing to tell yet
            if new_token_ids and req_id in self.forks.samples:
                self._start_parallel_samples(request, runner_output, outputs)
            accepted = request.append_output_tokens(new_token_ids, self.config.max_model_len)
            num_computed = self.spec.settle(request, sched_output, runner_output) if self.spec is not None else None
            if num_computed is not None:  # the rollback, computed once; the runner is told the table's length
                request.num_computed_tokens = num_computed
                self._num_kept_block_ids[req_id] = self.kv.trim(request, num_computed)
            logprobs = runner_output.logprobs.get(req_id)
            outputs.append(EngineCoreOutput(
                req_id, accepted, logprobs[: len(accepted)] if logprobs is not None else None, prompt_logprobs,
                request.status.finish_reason, request.stop_reason, num_cached_tokens=request.num_cached_tokens,
                queue_time=request.take_queue_time()))
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return outputs

    def _finish_pooled(self, request: Request, pooled: list[float] | None, outputs: list[EngineCoreOutput]) -> None:
        """A pooling request finishes with its last prompt chunk, the step that returns its vector (the
        chunks before it return nothing); its blocks go back at once, its full blocks still cached."""
        if pooled is None:
            if request.num_computed_tokens < request.num_tokens:
                return  # a prompt chunk
            # computed but not pooled: a runner without a pooling head; fail the request, not the engine
            self.finish_requests([request.req_id], RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(request.req_id, [], finish_reason="abort",
                                            error="the model runner returned no pooled vector (runner 'generate'?)"))
            return
        request.status = RequestStatus.FINISHED_STOPPED
        outputs.append(EngineCoreOutput(request.req_id, [], finish_reason="stop",
                                        num_cached_tokens=request.num_cached_tokens,
                                        queue_time=request.take_queue_time(), pooled=pooled))
        self.running.remove(request)
        self._free_request(request)

    # --- state -----------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def loading(self) -> list[Request]:
        """Requests waiting for their prefix blocks to be read from disk (not in `waiting` meanwhile)."""
        return self.disk.loading_requests if self.disk is not None else []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    # --- helpers ---------------------------------------------------------------------

    def _new_request_data(self, request: Request) -> NewRequestData:
        """The whole of a request the runner has no state for (computed tokens before this step's)."""
        self.kv.forget_replaced_blocks(request.req_id)  # the full table goes out: nothing to patch later
        samples = [(c.req_id, c.sampling_params) for c in self.forks.samples.get(request.req_id, ())]
        return NewRequestData(request.req_id, list(request.all_token_ids), request.num_prompt_tokens,
                              request.sampling_params, self.kv.get_block_ids(request.req_id), request.num_computed_tokens,
                              request.eos_token_ids, samples, request.lora_request, request.pooling_params)

    def _start_parallel_samples(self, leader: Request, runner_output: ModelRunnerOutput,
                                outputs: list[EngineCoreOutput]) -> None:
        """The leader's prompt is computed and its samples drew their first tokens: run them."""
        for child in self.forks.fork_samples(leader, runner_output.sampled_token_ids):
            self.running.append(child)
            child.check_stop(self.config.max_model_len)
            outputs.append(EngineCoreOutput(child.req_id, child.output_token_ids[-1:], runner_output.logprobs.get(
                child.req_id), None, child.status.finish_reason, child.stop_reason, num_cached_tokens=leader.num_cached_tokens))
            if child.is_finished:
                self.running.remove(child)
                self._free_request(child)

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
        self._num_kept_block_ids.pop(request.req_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _preempt_newest(self) -> list[Request]:
        """Preempt the policy's victims: the last running request, or the whole beam group it belongs to."""
        victims = take_victims(self.running)
        if victims[0].beam_group_id is not None:
            self.num_beam_group_preemptions += 1
        for victim in victims:  # newest first: appendleft leaves the group in its order at the queue's front
            self._preempt(victim)
        return victims

    def _free_request(self, request: Request) -> list[Request]:
        """Release a finished request; returns what finishing it finished too (samples that never started)."""
        self.kv.free(request)
        if self.disk is not None:
            self.disk.release(request)
        self._num_kept_block_ids.pop(request.req_id, None)
        if self.spec is not None:
            self.spec.forget(request.req_id)
        self._finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]
        if not (self.forks.leader_of or self.forks.unsent):
            return []  # no forks pending (every waiting sample is in leader_of): none can be this request's
        orphans = self.forks.forget(request)
        return self.finish_requests([o.req_id for o in orphans], request.status) if orphans else []
