"""The engine core's live beam groups: admitted, stepped after each engine step, reported, aborted.

The engine core hands every beam-search request here and passes each step's outputs through
`update`: the outputs of beams (internal core requests) are consumed, and a group's final beams
come out, under the front end's sequence ids, in the step the group finishes. This registry only
decides: `update` and `abort` return what the scheduler must do (`BeamStep`: fork these children,
finish those parents) and the engine core tells the scheduler. Nothing here calls the scheduler or
reads the KV cache manager.

    EngineCore.step:  scheduler.update_from_output -> outputs -> BeamGroups.update -> (outputs, steps)
                      for each step: scheduler.replace_beams(step.parent_ids, step.children)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedllm.config import SchedulerConfig
from pagedllm.core.beam_selection import BeamGroup
from pagedllm.core.request import EngineCoreRequest, Request
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.errors import InvalidRequestError


@dataclass(slots=True)
class BeamStep:
    """What one group's step asks of the scheduler: fork `children` from `parent_ids`, then finish the
    parents (a group that finished or failed has no children: its beams just end)."""

    group: BeamGroup
    parent_ids: list[str]
    children: list[tuple[int, str, int]]
    """(index into parent_ids, child id, the child's last token), in the group's new beam order."""


class BeamGroups:
    """Every beam group of one engine core, by request id and by beam id."""

    def __init__(self, config: SchedulerConfig, num_kv_blocks: int, num_blocks_for_tokens: Callable[[int], int]) -> None:
        """`num_blocks_for_tokens(n)`: the most blocks one beam of n tokens holds at once (the KV cache
        manager's `max_blocks_held`: fewer than n's whole length behind a sliding window)."""
        self.config = config
        self.num_kv_blocks = num_kv_blocks
        self.num_blocks_for_tokens = num_blocks_for_tokens
        self.groups: dict[str, BeamGroup] = {}
        self._group_of_output: dict[str, BeamGroup] = {}
        """Front-end sequence id -> its group (aborts arrive under these ids)."""
        self._group_of_beam: dict[str, BeamGroup] = {}
        self.finished_listeners: list[Callable[[BeamGroup], None]] = []
        """Called with each group that finished (offline beam_search reads its KV sharing here)."""

    def add(self, request: EngineCoreRequest) -> Request:
        """Start a group with its prompt as the only beam, returned for the scheduler to queue;
        InvalidRequestError (nothing registered) if this engine could never run it."""
        group = BeamGroup(request)
        config = self.config
        width = group.beam_width
        if width > config.max_num_seqs or width > config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"{width} beams must decode in one step: max_num_seqs ({config.max_num_seqs}) and "
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least the beam width"
            )
        # A group resumed by recomputation shares no blocks until its beams fork again: the whole
        # cache must hold every beam at its largest, unshared.
        num_tokens = len(request.prompt_token_ids) + request.max_tokens
        num_blocks = width * self.num_blocks_for_tokens(num_tokens)
        if num_blocks > self.num_kv_blocks:
            raise InvalidRequestError(
                f"{width} beams of up to {num_tokens} tokens need up to {num_blocks} KV blocks but the whole "
                f"cache has {self.num_kv_blocks}; raise kv_cache_memory, lower max_tokens or the beam width"
            )
        if request.req_id in self.groups or any(i in self._group_of_output for i in group.output_ids):
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        beam = group.first_beam()
        self._register(group, [beam.req_id])
        return beam

    def abort(self, req_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """Drop the groups named by any of their sequence ids. Returns (the ids that name no group, the
        beams of the dropped groups): the caller finishes both."""
        others, beams = [], []
        for req_id in req_ids:
            group = self._group_of_output.get(req_id)
            if group is None:
                others.append(req_id)
            elif group.req_id in self.groups:
                beams.extend(group.beam_req_ids)
                self._unregister(group)
        return others, beams

    def update(self, outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[BeamStep]]:
        """Consume the beams' outputs of one step. Returns the other outputs plus those of the groups
        that finished, and the steps the scheduler must take, in order (the new beams are registered)."""
        if not self.groups:
            return outputs, []
        passed: list[EngineCoreOutput] = []
        steps: list[BeamStep] = []
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
                steps.append(BeamStep(group, list(group.beam_req_ids), []))
                self._unregister(group)
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
            steps.append(BeamStep(group, parents, [] if group.done else children))
            if group.done:
                self._unregister(group)
                passed.extend(group.final_outputs())
                for listener in self.finished_listeners:
                    listener(group)
                continue
            self._register(group, [child_id for _, child_id, _ in children])
        return passed, steps

    # --- state ---------------------------------------------------------------------------

    @property
    def num_beams_running(self) -> int:
        return len(self._group_of_beam)

    def beam_req_ids(self) -> list[str]:
        """The core request ids of every group's live beams."""
        return list(self._group_of_beam)

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
