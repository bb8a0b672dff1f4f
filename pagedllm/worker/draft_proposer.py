"""Draft-model proposals for speculative decoding ('draft_model'), made in the runner.

A smaller model with the target's vocabulary runs greedily, in the same step and just before the
target scores its guesses. Its KV cache has the target's block layout (same num_blocks and
block_size) and is indexed by the same block tables and slot mapping, so the scheduler's blocks hold
both caches; copy-on-write copies and swaps apply to both (ModelRunner).

One step, for a request the scheduler gave k draft slots (its last token t at position L - 1):

    positions:    d ......... L-1 | L    L+1 ... L+k-2
    draft input:  catch-up tokens t | p1   p2  ... p(k-1)     one varlen pass, then k - 1 one-token passes
    proposals:                   p1 | p2   p3  ... pk         argmax of each position (q = one-hot)

`d` is the first position without valid draft KV. Normally d = L - 1 (one token); d = L - 2 after a
step that kept all k proposals (pk's KV was never written). While the draft gate is open, the draft
also runs over prompt chunks with the target, in the same step, so a prompt's draft KV is there
when its request first proposes. The KV of p1..p(k-1) is valid only where the target kept them: the
next step extends `d` over the kept ones (the first rejected position always holds a different
token, so the check is exact).

While the gate finds the draft seldom right (SchedulerOutput.draft_keep_up is False), the draft runs
only for the requests that propose: none while the gate is closed, one-token probes when it reopens.
Prompt chunks and decode steps leave its KV behind; a request catches up when it next proposes,
over at most MAX_CATCH_UP of the missing positions (the latest ones).

Draft KV that is stale (a prefix-cache hit on blocks whose draft KV was never computed, a lag longer
than MAX_CATCH_UP) only lowers acceptance: the target verifies every proposal, so outputs never
depend on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.errors import ModelLoadError
from pagedllm.model.forward_context import set_forward_context
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_kv_caches
from pagedllm.worker.model_runner import RunnerRequestState

logger = logging.getLogger(__name__)

PrepareInputs = Callable[[list, list[int]], tuple]
"""ModelRunner.prepare_inputs: (rows, tokens per row) -> (input ids, positions, attention metadata)."""

MAX_CATCH_UP = 16
"""Most positions of missing draft KV one request recomputes in a step, before its own tokens. A
request whose draft lagged longer (the draft gate or its backoff paused it) proposes over stale KV
there: cheaper than a pass over the whole lag at each reopening, and it only lowers acceptance."""


@dataclass(slots=True)
class _DraftRow:
    """What the runner's input preparation reads of a request: tokens, computed count, block table."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]


def load_draft_model(path: str, target_vocab_size: int, dtype: torch.dtype, device: str,
                     quant_activations: str = "none"):
    """The draft model (model/loader.py), refused unless its vocabulary is the target's; ``quant_activations``
    as the target's (its proposals only change how many tokens are accepted)."""
    from pagedllm.model.loader import load_model

    loaded = load_model(path, dtype=dtype, device=device, quant_activations=quant_activations)
    vocab_size = loaded.hf_config.vocab_size
    if vocab_size != target_vocab_size:
        raise ModelLoadError(f"the draft model {path!r} has a vocabulary of {vocab_size} tokens, the target "
                             f"{target_vocab_size}: a draft model must share the target's tokenizer")
    return loaded


class DraftProposer:
    """The draft model, its KV caches (device and swap) and how far each request's draft KV is valid."""

    def __init__(self, model: torch.nn.Module, kv_spec: KVCacheSpec, num_blocks: int, num_host_blocks: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_spec = kv_spec
        self.kv_caches = allocate_kv_caches(kv_spec, num_blocks, device)
        self.host_kv_caches = allocate_kv_caches(kv_spec, num_host_blocks, "cpu") if num_host_blocks else []
        if device.type == "cuda":
            self.host_kv_caches = [cache.pin_memory() for cache in self.host_kv_caches]
        self._num_computed: dict[str, int] = {}
        """req_id -> positions [0, n) hold valid draft KV (absent: the target's computed count)."""
        self._unverified: dict[str, list[int]] = {}
        """req_id -> proposals whose draft KV sits right after _num_computed, valid if the target kept them."""
        self.num_failures = 0
        self.num_forward_passes = 0
        self.num_forward_tokens = 0
        """Draft passes run and tokens they computed (what the draft costs, for tests and benchmarks)."""

    def update(self, sched: SchedulerOutput) -> None:
        """Forget finished and preempted requests, and any that (re)start from the scheduler's data."""
        for req_id in [*sched.finished_req_ids, *sched.preempted_req_ids, *(n.req_id for n in sched.scheduled_new_reqs)]:
            self._num_computed.pop(req_id, None)
            self._unverified.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, states: Mapping[str, RunnerRequestState], sched: SchedulerOutput,
                prepare_inputs: PrepareInputs) -> dict[str, list[int]]:
        """req_id -> the k proposals for each request in `sched.num_draft_tokens`; also catches the
        draft KV up over the prompt chunks the target computes this step.

        `states`: the runner's requests (their tokens, computed counts and block tables, as of this step);
        `prepare_inputs`: the runner's input preparation (ModelRunner.prepare_inputs), so the draft's
        slots and block tables are read exactly as the target's."""
        try:
            return self._propose(states, sched, prepare_inputs)
        except Exception:  # noqa: BLE001 - any proposal is lossless; a failing draft must not fail requests
            self.num_failures += 1
            logger.exception("the draft model failed; scoring placeholder proposals this step")
            for req_id in sched.num_scheduled_tokens:
                self._num_computed.pop(req_id, None)
                self._unverified.pop(req_id, None)
            return {req_id: [0] * k for req_id, k in sched.num_draft_tokens.items()}

    def _propose(self, states: Mapping[str, RunnerRequestState], sched: SchedulerOutput,
                 prepare: PrepareInputs) -> dict[str, list[int]]:
        num_draft = sched.num_draft_tokens
        catch_up: list[tuple[str, _DraftRow, int]] = []  # (req_id, row, tokens to compute)
        for req_id, n in sched.num_scheduled_tokens.items():
            state = states[req_id]
            if req_id in num_draft:
                end = len(state.token_ids)  # its proposals are not attached yet
            elif n > 1 and sched.draft_keep_up:
                end = state.num_computed_tokens + n  # a prompt chunk (or a recomputed history)
            else:
                # No pass: a decode step without proposals, or a prompt chunk while the gate finds the
                # draft seldom right. The draft's KV misses these tokens until the request proposes.
                self._num_computed.setdefault(req_id, state.num_computed_tokens)
                continue
            start = min(self._valid_end(req_id, state), state.num_computed_tokens)
            # A long lag (the gate or the request's backoff paused it) is cheaper left stale than
            # recomputed: only the last MAX_CATCH_UP positions before this step's own tokens are.
            start = max(start, state.num_computed_tokens - MAX_CATCH_UP)
            catch_up.append((req_id, _DraftRow(state.token_ids, start, state.block_ids), end - start))
            self._num_computed[req_id] = end
        if not catch_up:
            return {}
        hidden, last_rows = self._forward(prepare, [row for _, row, _ in catch_up], [n for _, _, n in catch_up])
        proposals: dict[str, list[int]] = {}
        want = [(req_id, last_rows[i]) for i, (req_id, _, _) in enumerate(catch_up) if req_id in num_draft]
        if want:
            first = self._argmax(hidden[[row for _, row in want]])
            for (req_id, _), token in zip(want, first):
                proposals[req_id] = [token]
        for j in range(1, max(num_draft.values(), default=0)):
            going = [req_id for req_id in proposals if num_draft[req_id] > j]
            rows = []
            for req_id in going:
                state = states[req_id]
                tokens = state.token_ids + proposals[req_id]
                rows.append(_DraftRow(tokens, len(tokens) - 1, state.block_ids))
            hidden, _ = self._forward(prepare, rows, [1] * len(rows))
            for req_id, token in zip(going, self._argmax(hidden)):
                proposals[req_id].append(token)
        for req_id, props in proposals.items():
            self._unverified[req_id] = props[:-1]  # the last one's KV is not written
        return proposals

    def _valid_end(self, req_id: str, state) -> int:
        """End of the request's valid draft KV: the last known end, extended over the proposals the
        target kept (they are now the request's tokens at those positions)."""
        end = self._num_computed.get(req_id)
        if end is None:
            return state.num_computed_tokens
        for token in self._unverified.pop(req_id, []):
            if end >= len(state.token_ids) or state.token_ids[end] != token:
                break
            end += 1
        return end

    def _forward(self, prepare, rows: list[_DraftRow], counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Run the draft over `counts[i]` tokens of rows[i] from its num_computed_tokens: (hidden states
        [num_tokens, hidden], each row's last index in them)."""
        self.num_forward_passes += 1
        self.num_forward_tokens += sum(counts)
        input_ids, positions, metadata = prepare(rows, counts)
        with set_forward_context(metadata, self.kv_caches):
            hidden = self.model(input_ids, positions)
        return hidden, _last_indices(counts)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()


def _last_indices(counts: list[int]) -> list[int]:
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total - 1)
    return ends
