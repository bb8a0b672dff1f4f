"""The model runner: SchedulerOutput -> tensors -> model -> sampled tokens.

It keeps a copy of each running request's tokens and block table, updated from the
scheduler's diffs, so a step's inputs are built from what changed, not resent in full.
How many tokens are computed and how long the block table is are the scheduler's to say
(CachedRequestData): the runner takes them as sent, and never works them out again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from pagedllm.config import SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.lora.layers import lora_step
from pagedllm.model import batch_invariant as batch_invariant_mode
from pagedllm.model.attention.backend import make_attention_backend
from pagedllm.model.attention.layer import set_attention_backend
from pagedllm.lora.request import LoRARequest
from pagedllm.model.forward_context import InputRow, build_step_inputs, set_forward_context
from pagedllm.model.sampling.logprobs import compute_prompt_logprobs
from pagedllm.model.sampling.metadata import RequestTensorCache, RequestTensors, SamplingMetadata, SamplingRow, plain_greedy
from pagedllm.model.sampling.sampler import Sampler, SamplerOutput, greedy_tokens
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker import kv_block_io, spec_verify
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_kv_caches

logger = logging.getLogger(__name__)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@dataclass(slots=True)
class RunnerRequestState:
    """A running request as the runner keeps it, updated from the scheduler's diffs (a row of the step's inputs)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int]
    fork_children: list[tuple[str, SamplingParams]]
    """Parallel samples drawn from this request's first sampling logits (then forked by the scheduler)."""
    tensors: RequestTensors | None = None
    """logit_bias and min_tokens ids as tensors, shared with the request's other sequences (None: built
    per step, for states made outside the runner)."""
    lora_request: LoRARequest | None = None
    """The adapter this request generates with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling request: pooled when its prompt is computed, never sampled."""


class ModelRunner:
    """Owns the model, the KV cache tensors and the per-request state needed to build inputs.

    Every setting comes from the caller's configs (no defaults of its own): `seed` and
    `attention_backend` from EngineArgs; `cuda_graphs`, the SchedulerConfig whose max_num_seqs and
    max_model_len bound the decode steps captured as CUDA graphs, or None to run every step eagerly
    (enforce_eager, or a tensor-parallel rank).
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, kv_spec: KVCacheSpec, num_blocks: int, *,
                 num_host_blocks: int, device: torch.device | str, seed: int, attention_backend: str,
                 cuda_graphs: SchedulerConfig | None, load_tokenizer=lambda: None, draft=None, lora=None,
                 batch_invariant: bool, pooling=None) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.kv_spec = kv_spec
        self.block_size = kv_spec.block_size
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_caches(kv_spec, num_blocks, self.device)
        # Swap space in host memory (pinned when the device is a GPU), same layout as the device cache.
        self.host_kv_caches = allocate_kv_caches(kv_spec, num_host_blocks, "cpu") if num_host_blocks else []
        if self.device.type == "cuda":  # pinned: device<->host block copies by DMA
            self.host_kv_caches = [cache.pin_memory() for cache in self.host_kv_caches]
        # EngineArgs.batch_invariant: kernels with a fixed per-row sum order, chosen when the model was built
        if batch_invariant and not batch_invariant_mode.built_for(model):
            raise ValueError("batch_invariant: the model was not built in the mode (load it inside "
                             "model.batch_invariant.building(True))")
        self.attn_backend = make_attention_backend(attention_backend, self.device, batch_invariant)
        set_attention_backend(model, self.attn_backend)
        self.lora = lora
        """The LoRA adapters' manager (pagedllm/lora/manager.py) when LoRA is enabled; None otherwise."""
        self.draft = draft
        """The draft model's proposer (worker/draft_proposer.py) for speculative 'draft_model'; None otherwise."""
        # Block copies and swaps move the draft's KV with the target's: its cache shares the block ids.
        self._block_caches = self.kv_caches + (draft.kv_caches if draft is not None else [])
        self._host_block_caches = self.host_kv_caches + (draft.host_kv_caches if draft is not None else [])
        if draft is not None:
            set_attention_backend(draft.model, self.attn_backend)
        self.decode_graphs = None  # CUDA graphs of decode steps (CUDA, not enforce_eager)
        if self.device.type == "cuda" and cuda_graphs is not None and self.attn_backend.supports_cuda_graphs:
            from pagedllm.worker.gpu import DecodeGraphRunner

            self.decode_graphs = DecodeGraphRunner(model, self.kv_caches, cuda_graphs.max_num_seqs,
                                                   cuda_graphs.max_model_len, self.block_size, self.device)
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}
        self.request_tensors = RequestTensorCache(vocab_size, self.device)
        # Seeded requests keep their generator across preemption; dropped only when finished.
        self.generators: dict[str, torch.Generator] = {}
        self._spec_tokens: dict[str, list[int]] = {}
        """This step's speculative proposals (worker/spec_verify.py), req_id -> tokens."""
        torch.manual_seed(seed)  # the shared stream of unseeded requests
        self.load_tokenizer = load_tokenizer
        """Returns the tokenizer structured outputs build their vocabulary from (read at the first constrained request)."""
        self.structured_output = None  # a StructuredOutputManager, made at the first constrained request
        self.pooling = pooling
        """A worker.pooling.PoolingRunner when the model serves pooling requests (runner 'pooling'); else None."""

    # --- state updates from the scheduler's diffs ------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self._drop_state(req_id)
            if self.pooling is not None:
                self.pooling.drop(req_id)
            self.generators.pop(req_id, None)
            if self.structured_output is not None:
                self.structured_output.drop(req_id)
        for req_id in sched.preempted_req_ids:
            self._drop_state(req_id)
            if self.structured_output is not None:  # rebuilt from the output tokens when it resumes
                self.structured_output.drop(req_id)
        for new in sched.scheduled_new_reqs:
            self._drop_state(new.req_id)  # a preempted request resumed in the same step it was preempted
            eos_token_ids = sorted(new.eos_token_ids)
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_ids=eos_token_ids,
                fork_children=list(new.fork_children),
                tensors=self.request_tensors.acquire(new.sampling_params, eos_token_ids),
                lora_request=new.lora_request,
                pooling_params=new.pooling_params,
            )
            self._ensure_generator(new.req_id, new.sampling_params)
            for child_id, child_params in new.fork_children:
                self._ensure_generator(child_id, child_params)
            if new.sampling_params.structured_outputs is not None:
                self._add_structured(new, eos_token_ids)
        for cached in sched.scheduled_cached_reqs:  # in CachedRequestData's order: cut, replace, append
            state = self.requests[cached.req_id]
            if cached.num_kept_block_ids is not None:  # a speculative rollback freed the tail blocks
                del state.block_ids[cached.num_kept_block_ids:]
            for index, block_id in cached.replaced_block_ids.items():
                state.block_ids[index] = block_id
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _add_structured(self, new, eos_token_ids: list[int]) -> None:
        """Start compiling the request's grammar now, off the step: its first sampling step waits for it."""
        if self.structured_output is None:
            from pagedllm.structured.grammar import StructuredOutputManager  # xgrammar only when used

            tokenizer = self.load_tokenizer()
            assert tokenizer is not None, "the front end refuses structured outputs without a tokenizer"
            self.structured_output = StructuredOutputManager(tokenizer, self.vocab_size, eos_token_ids,
                                                             self.device)
        spec = new.sampling_params.structured_outputs
        for req_id in [new.req_id] + [child_id for child_id, _ in new.fork_children]:
            self.structured_output.add_sequence(req_id, spec, eos_token_ids)

    def _drop_state(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.request_tensors.release(state.params, state.eos_token_ids)

    def _ensure_generator(self, req_id: str, params: SamplingParams) -> None:
        if params.seed is not None and req_id not in self.generators:
            self.generators[req_id] = torch.Generator(device=self.device).manual_seed(params.seed)

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Blocks' K/V as bytes, outside a step (the disk tier keeps the cached prefixes at shutdown)."""
        return kv_block_io.read_blocks(self._block_caches, block_ids)

    # --- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        # Order matters: blocks spilled or swapped out may be the very blocks loaded, swapped in or copied into now.
        spilled = kv_block_io.read_blocks(self._block_caches, sched.kv_spill) if sched.kv_spill else []
        if sched.swap_out:
            kv_block_io.swap_blocks(sched.swap_out, self._block_caches, self._host_block_caches)
        if sched.kv_load:
            kv_block_io.write_blocks(self._block_caches, sched.kv_load)
        if sched.swap_in:
            kv_block_io.swap_blocks(sched.swap_in, self._host_block_caches, self._block_caches)
        if sched.block_copies:
            kv_block_io.copy_blocks(sched.block_copies, self._block_caches)
        self._spec_tokens = sched.scheduled_spec_tokens
        if self.draft is not None:
            self.draft.update(sched)
            if sched.total_num_scheduled_tokens:  # fills sched.num_draft_tokens' slots
                self._spec_tokens = self.draft.propose(self.requests, sched, self.prepare_inputs)
        if self._spec_tokens:
            spec_verify.attach_proposals(self.requests, self._spec_tokens)
        if not sched.total_num_scheduled_tokens:
            return ModelRunnerOutput(sampled_token_ids={}, kv_spilled=spilled)

        req_ids = list(sched.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [sched.num_scheduled_tokens[r] for r in req_ids]
        lora_failed = {}
        if self.lora is not None:  # adapters resident, each adapter's rows side by side (one segment each)
            order, failed = self.lora.prepare_step([s.lora_request for s in states])
            lora_failed = {states[i].req_id: error for i, error in failed.items()}
            states, num_scheduled = [states[i] for i in order], [num_scheduled[i] for i in order]
        output = self._execute_isolating_failures(states, num_scheduled) if states else \
            ModelRunnerOutput(sampled_token_ids={})
        output.failed.update(lora_failed)
        if sched.num_draft_tokens:  # the scheduler counts acceptance against what was scored
            output.spec_token_ids = {r: self._spec_tokens[r] for r in sched.num_draft_tokens}
        output.kv_spilled = spilled
        return output

    def _execute_isolating_failures(self, states: list[RunnerRequestState], num_scheduled: list[int]) -> ModelRunnerOutput:
        try:
            return self._execute(states, num_scheduled)
        except Exception as error:  # noqa: BLE001 - isolate the failing request, keep the others
            if len(states) == 1:
                logger.exception("request %s failed", states[0].req_id)
                return ModelRunnerOutput(sampled_token_ids={}, failed={states[0].req_id: _describe(error)})
            logger.warning("a batch of %d requests failed (%s); retrying each alone", len(states), _describe(error))
        # Re-running a request alone rewrites the same KV slots with the same values: no harm done.
        merged = ModelRunnerOutput(sampled_token_ids={})
        for state, n in zip(states, num_scheduled):
            try:
                alone = self._execute([state], [n])
            except Exception as error:  # noqa: BLE001
                logger.exception("request %s failed", state.req_id)
                merged.failed[state.req_id] = _describe(error)
                continue
            merged.sampled_token_ids.update(alone.sampled_token_ids)
            merged.logprobs.update(alone.logprobs)
            merged.prompt_logprobs.update(alone.prompt_logprobs)
            merged.pooled.update(alone.pooled)
            merged.failed.update(alone.failed)
        return merged

    def _execute(self, states: list[RunnerRequestState], num_scheduled: list[int]) -> ModelRunnerOutput:
        """Forward, sample, and only then append the sampled tokens (so a failure changes nothing). The
        computed counts move on with the scheduler's next CachedRequestData."""
        if not getattr(self.model, "uses_kv_cache", True):  # an encoder: whole sequences, no KV
            return self.pooling.execute_encoder(self.model, states, num_scheduled, self.device)
        input_ids, positions, metadata = self.prepare_inputs(states, num_scheduled)
        lora_rows = None if self.lora is None else self.lora.step_rows([s.lora_request for s in states], num_scheduled)
        if self.decode_graphs is not None and lora_rows is None and self.decode_graphs.can_run(metadata):
            hidden_states = self.decode_graphs.run(input_ids, positions, metadata)
        elif self.lora is None:  # nothing set a LoRA step: no block to reset it in
            with set_forward_context(metadata, self.kv_caches):
                hidden_states = self.model(input_ids, positions)  # [num_tokens, hidden]
        else:
            with set_forward_context(metadata, self.kv_caches), lora_step(lora_rows):
                hidden_states = self.model(input_ids, positions)

        output = ModelRunnerOutput(sampled_token_ids={})
        self._compute_prompt_logprobs(states, num_scheduled, metadata, hidden_states, output)
        if self.pooling is not None:
            self.pooling.collect(states, num_scheduled, hidden_states, output.pooled, output.failed)
        # Rows that reach the end of their known tokens sample the next one (pooling rows never sample).
        sampling_rows = [i for i, (s, n) in enumerate(zip(states, num_scheduled))
                         if s.num_computed_tokens + n == len(s.token_ids) and s.pooling_params is None]
        spec_rows = [i for i in sampling_rows if states[i].req_id in self._spec_tokens]
        kept_by_state: dict[str, list[int]] = {}
        if spec_rows:
            sampling_rows = [i for i in sampling_rows if states[i].req_id not in self._spec_tokens]
            kept_by_state = spec_verify.verify_rows(self, states, spec_rows, self._spec_tokens, metadata,
                                                    hidden_states, output)
        sampled_by_state: dict[str, int] = {}
        if sampling_rows:
            sampled_by_state = self._sample(states, sampling_rows, metadata, hidden_states, output)

        for state in states:
            if state.req_id in kept_by_state:
                spec_verify.commit(state, len(self._spec_tokens[state.req_id]), kept_by_state[state.req_id])
            elif state.req_id in sampled_by_state:
                state.token_ids.append(sampled_by_state[state.req_id])
                state.fork_children = []  # they drew their first tokens from these logits
        return output

    def _sample(self, states, sampling_rows, metadata, hidden_states, output) -> dict[str, int]:
        """Sample one token per sequence; parallel samples about to fork reuse their leader's hidden row."""
        row_owner: list[tuple[RunnerRequestState, str, SamplingParams]] = []
        hidden_rows: list[int] = []
        for i in sampling_rows:
            state = states[i]
            for req_id, params in [(state.req_id, state.params)] + state.fork_children:
                row_owner.append((state, req_id, params))
                hidden_rows.append(i)
        last_token = [end - 1 for end in accumulate(metadata.query_lens_host)]  # request i's last row
        rows_taken = [last_token[i] for i in hidden_rows]
        if rows_taken == list(range(hidden_states.shape[0])):  # a decode step without forks: every row, in order
            sampled_hidden = hidden_states
        else:
            sampled_hidden = hidden_states[torch.tensor(rows_taken, device=hidden_states.device)]
        if all(plain_greedy(params) for _, _, params in row_owner):  # argmax of the raw logits, no metadata
            sampled = greedy_tokens(self.model, sampled_hidden).token_ids.tolist()  # the step's one host sync
            for (state, req_id, _), token in zip(row_owner, sampled):
                output.sampled_token_ids[req_id] = [token]
            return {state.req_id: token for (state, req_id, _), token in zip(row_owner, sampled)
                    if req_id == state.req_id}
        rows = [
            SamplingRow(
                params=params,
                prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
                output_token_ids=state.token_ids[state.num_prompt_tokens :],
                generator=self.generators.get(req_id),
                eos_token_ids=state.eos_token_ids,
                # a parallel sample about to fork shares its leader's params objects, hence its tensors
                tensors=state.tensors if params is state.params
                else self.request_tensors.peek(params, state.eos_token_ids),
            )
            for state, req_id, params in row_owner
        ]
        sampling_metadata = SamplingMetadata.from_requests(rows, self.vocab_size, self.device)
        if self.structured_output is not None:  # grammar masks for the constrained rows
            sampling_metadata.token_bitmask = self.structured_output.fill_bitmask(
                [(req_id, row.output_token_ids) for (_, req_id, _), row in zip(row_owner, rows)])
        if (sampling_metadata.all_greedy and not sampling_metadata.has_logits_processors
                and sampling_metadata.max_num_logprobs is None):  # only each row's argmax is wanted
            sampler_output = SamplerOutput(greedy_tokens(self.model, sampled_hidden).token_ids, None, None, None)
        else:
            logits = self.model.compute_logits(sampled_hidden)  # [num_rows, vocab]
            sampler_output = self.sampler(logits, sampling_metadata)

        sampled = sampler_output.sampled_token_ids.tolist()  # the step's one host sync
        if sampling_metadata.token_bitmask is not None:
            for row in sampling_metadata.token_bitmask[1]:
                req_id = row_owner[row][1]
                try:
                    self.structured_output.accept(req_id, sampled[row])
                except ValueError as error:  # e.g. min_tokens held back the EOS the grammar needed
                    output.failed[req_id] = str(error)
        logprob_ids = logprob_values = ranks = None
        if sampler_output.logprobs is not None:
            logprob_ids = sampler_output.logprob_token_ids.tolist()
            logprob_values = sampler_output.logprobs.tolist()
            ranks = sampler_output.sampled_token_ranks.tolist()
        sampled_by_state = {}
        for row, (state, req_id, params) in enumerate(row_owner):
            if req_id == state.req_id:
                sampled_by_state[req_id] = sampled[row]
            output.sampled_token_ids[req_id] = [sampled[row]]
            num_logprobs = params.logprobs
            if num_logprobs is not None and logprob_ids is not None:
                output.logprobs[req_id] = [
                    TokenLogprobs(logprob_ids[row][: num_logprobs + 1], logprob_values[row][: num_logprobs + 1], ranks[row])
                ]
        return sampled_by_state

    def prepare_inputs(self, states: Sequence[InputRow], num_scheduled: list[int]):
        """Flat token ids, positions and attention metadata for `num_scheduled[i]` tokens of states[i]
        (``forward_context.build_step_inputs``); the draft proposer reads its inputs here too."""
        return build_step_inputs(states, num_scheduled, self.block_size, self.device)

    def _compute_prompt_logprobs(self, states, num_scheduled, metadata, hidden_states, output) -> None:
        """Logprobs of the prompt tokens this step covers: position p predicts token p + 1."""
        for i, (state, n) in enumerate(zip(states, num_scheduled)):
            k = state.params.prompt_logprobs
            start = state.num_computed_tokens
            if k is None or start >= state.num_prompt_tokens:
                continue
            end = min(start + n, state.num_prompt_tokens - 1)  # the last prompt position predicts output
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if end > start:
                first = int(metadata.query_start_loc[i])
                logits = self.model.compute_logits(hidden_states[first : first + end - start])
                targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=self.device)
                ids, values, ranks = compute_prompt_logprobs(logits, targets, k)
                for row_ids, row_values, rank in zip(ids.tolist(), values.tolist(), ranks.tolist()):
                    entries.append(TokenLogprobs(row_ids, row_values, rank))
            output.prompt_logprobs[state.req_id] = entries
