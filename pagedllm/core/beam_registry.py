"""The engine core's live beam groups: admitted, stepped after each engine step, reported, aborted.

EngineCore hands every beam-search request here and passes each step's outputs through
`update`: the outputs of beams (internal core requests) are consumed, and a group's final
beams come out, under the front end's sequence ids, in the step the group finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedllm.core.beam_selection import BeamGroup
from pagedllm.core.forking import kv_block_usage
from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import InvalidRequestError


class BeamGroups:
    """Every beam group of one engine core, by request id and by beam id."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamGroup] = {}
        self._group_of_output: dict[str, BeamGroup] = {}
        """Front-end sequence id -> its group (aborts arrive under these ids)."""
        self._group_of_beam: dict[str, BeamGroup] = {}
        self.finished_listeners: list[Callable[[BeamGroup], None]] = []
        """Called with each group that finished (offline beam_search reads its KV sharing here)."""

    def add(self, request: EngineCoreRequest) -> None:
        """Start a group with its prompt as the only beam; InvalidRequestError if this engine could never run it."""
        group = BeamGroup(request)
        config = self.scheduler.config
        kv = self.scheduler.kv
        width = group.beam_width
        if width > config.max_num_seqs or width > config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"{width} beams must decode in one step: max_num_seqs ({config.max_num_seqs}) and "
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least the beam width"
            )
        # A group resumed by recomputation shares no blocks until its beams fork again: the whole
        # cache must hold every beam at full length, unshared.
        num_blocks = width * kv.num_blocks_for_tokens(len(request.prompt_token_ids) + request.max_tokens)
        if num_blocks > kv.num_blocks:
            raise InvalidRequestError(
                f"{width} beams of up to {len(request.prompt_token_ids) + request.max_tokens} tokens need up to "
                f"{num_blocks} KV blocks but the whole cache has {kv.num_blocks}; raise kv_cache_memory, "
                f"lower max_tokens or the beam width"
            )
        if request.req_id in self.groups or any(i in self._group_of_output for i in group.output_ids):
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        beam = group.first_beam()
        self.scheduler.add_request(beam)
        self._register(group, [beam.req_id])

    def abort(self, req_ids: Iterable[str]) -> list[str]:
        """Abort the groups named by any of their sequence ids; returns the ids that name no group."""
        others = []
        for req_id in req_ids:
            group = self._group_of_output.get(req_id)
            if group is None:
                others.append(req_id)
            elif group.req_id in self.groups:
                self._drop(group)
        return others

    def update(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Consume the beams' outputs of one step; returns the others, plus the groups that finished."""
        if not self.groups:
            return outputs
        passed: list[EngineCoreOutput] = []
        by_group: dict[str, dict[str, EngineCoreOutput]] = {}
        for out in outputs:
            group = self._group_of_beam.get(out.req_id)
            if group is None:
                passed.append(out)
            else:
                by_group.setdefault(group.req_id, {})[out.req_id] = out
        for group_id, beam_outputs in by_group.items():
            group = self.groups[group_id]
            failed = next((o for o in beam_outputs.values() if o.finish_reason == "abort"), None)
            if failed is not None:
                self._drop(group)
                passed.extend(group.failed_outputs(failed.error or "a beam of this request failed"))
                continue
            sampled = [beam_outputs.get(req_id) for req_id in group.beam_req_ids]
            if not any(out is not None and out.new_token_ids for out in sampled):
                continue  # the prompt is still being computed in chunks
            assert all(out is not None and out.new_token_ids for out in sampled), \
                f"{group_id}: the scheduler let some beams sample without the others"
            children = group.step(sampled)
            parents = group.beam_req_ids
            for req_id in parents:
                del self._group_of_beam[req_id]
            if group.done:
                self.scheduler.finish_requests(parents, RequestStatus.FINISHED_ABORTED)
                self._unregister(group)
                passed.extend(group.final_outputs())
                for listener in self.finished_listeners:
                    listener(group)
                continue
            kids = self.scheduler.replace_beams(parents, children)
            self._register(group, [kid.req_id for kid in kids])
            group.sharing.record(*kv_block_usage(self.scheduler.kv, group.beam_req_ids))
        return passed

    # --- state ---------------------------------------------------------------------------

    @property
    def num_beams_running(self) -> int:
        return len(self._group_of_beam)

    def kv_block_usage(self) -> tuple[int, int]:
        """(distinct KV blocks every group's beams hold, the sum of their block-table lengths)."""
        return kv_block_usage(self.scheduler.kv, self._group_of_beam)

    def _register(self, group: BeamGroup, beam_req_ids: list[str]) -> None:
        self.groups[group.req_id] = group
        for out_id in group.output_ids:
            self._group_of_output[out_id] = group
        group.beam_req_ids = beam_req_ids
        for req_id in beam_req_ids:
            self._group_of_beam[req_id] = group

    def _unregister(self, group: BeamGroup) -> None:
        self.groups.pop(group.req_id, None)
        for out_id in group.output_ids:
            self._group_of_output.pop(out_id, None)
        for req_id in group.beam_req_ids:
            self._group_of_beam.pop(req_id, None)
        group.beam_req_ids = []

    def _drop(self, group: BeamGroup) -> None:
        beams = list(group.beam_req_ids)
        self._unregister(group)
        self.scheduler.finish_requests(beams, RequestStatus.FINISHED_ABORTED)
