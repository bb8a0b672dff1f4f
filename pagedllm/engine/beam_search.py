"""Beam search over the engine core, with beams sharing KV blocks copy-on-write.

Every live beam of every prompt decodes one token per engine step, all batched together
(continuous batching across prompts). A beam is a core request whose SamplingParams ask for
the top 2k logprobs (k = beam_width); the core's greedy pick is ignored. After the step each
prompt chooses its next beams, and each chosen (parent, token) becomes a child forked from the
parent (`EngineCore.fork_request`: the parent's block table, ref counts up, nothing copied); then
every parent is aborted, so a pruned beam's blocks are released at once and only the children's
references remain. The first time two children of one parent write, the scheduler's KV manager
copies the shared, partially filled last block for the first writer; full blocks are never copied.

    step t:   parent P (tokens ... x, KV computed up to x's predecessor)
              top-2k logprobs of every live beam -> HF selection -> (P, a), (P, b), (Q, c)
              fork P->A(last=a), P->B(last=b), Q->C(last=c); abort P, Q
    step t+1: A, B, C each compute their last token (A or B copies the shared partial block)

Conventions (those of Hugging Face transformers' `_beam_search`, greedy, matched exactly):

- Candidates. Each step takes the top K = max(2, 1 + number of EOS ids) * k continuations over
  all beams by cumulative logprob (the raw log_softmax of the model's logits, summed). At the
  first step only the prompt is a beam. With ignore_eos there are no EOS ids (HF:
  eos_token_id=None) and EOS is an ordinary token, so K = 2k.
- A candidate "finishes" when its token is an EOS id or it reaches max_tokens. Only finishing
  candidates ranked among the top k of the K become finished hypotheses; the others are dropped.
  The next step's beams are the best k candidates that do not finish, in rank order.
- Score of a finished hypothesis: cumulative logprob / L ** length_penalty, where L is its
  generated length including the EOS token (the prompt is not counted). This is HF's
  `sequences_scores`. A prompt keeps the k best finished hypotheses.
- Early stopping, checked after each step once k hypotheses are finished:
    False    stop when best running beam's cumulative logprob / t ** length_penalty (t = tokens
             generated so far) is not above the worst kept finished score; HF's heuristic, which
             can be wrong when length_penalty > 0 favours longer beams;
    "never"  the same, but with t = max_tokens when length_penalty > 0 (exact bound);
    True     stop as soon as k hypotheses are finished.
  A stopped prompt takes no further hypotheses; every prompt stops at max_tokens at the latest.
- Output: the best `num_return_sequences` (default k) finished hypotheses, best score first,
  token_ids including the final EOS. max_tokens is capped by what max_model_len leaves.

KV sharing is measured after each step: the distinct blocks the prompt's beams hold against the
sum of their block-table lengths (what they would hold without sharing); see `KVSharingStats`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedllm.core.forking import kv_block_usage  # noqa: F401  (bench.sharing reads it from here)
from pagedllm.core.kv_cache_manager import cdiv
from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.engine.input_processor import PromptType
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

_run_ids = itertools.count()


# --- results ----------------------------------------------------------------------------------


@dataclass(slots=True)
class KVSharingStats:
    """KV blocks held by beams with sharing vs without, summed over the engine steps measured."""

    num_steps: int = 0
    num_blocks_held: int = 0
    """Sum over steps of the distinct blocks the beams held."""
    num_blocks_unshared: int = 0
    """Sum over steps of each beam's block-table length: what they would hold without sharing."""

    def record(self, num_held: int, num_unshared: int) -> None:
        self.num_steps += 1
        self.num_blocks_held += num_held
        self.num_blocks_unshared += num_unshared

    def merge(self, other: KVSharingStats) -> None:
        self.num_steps = max(self.num_steps, other.num_steps)
        self.num_blocks_held += other.num_blocks_held
        self.num_blocks_unshared += other.num_blocks_unshared

    @property
    def saved_fraction(self) -> float:
        """1 - held / unshared: the fraction of blocks sharing saved (0 when nothing was measured)."""
        return 1.0 - self.num_blocks_held / self.num_blocks_unshared if self.num_blocks_unshared else 0.0

    @property
    def mean_blocks_held(self) -> float:
        return self.num_blocks_held / self.num_steps if self.num_steps else 0.0

    @property
    def mean_blocks_unshared(self) -> float:
        return self.num_blocks_unshared / self.num_steps if self.num_steps else 0.0


@dataclass(slots=True)
class BeamSequence:
    """One finished beam."""

    token_ids: list[int]
    """Generated tokens only, including a final EOS."""
    text: str
    cumulative_logprob: float
    score: float
    """cumulative_logprob / len(token_ids) ** length_penalty (HF's sequences_scores)."""
    finish_reason: str
    """'stop' (ended by EOS) or 'length' (max_tokens or max_model_len)."""


@dataclass(slots=True)
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    """Best score first."""
    kv_sharing: KVSharingStats = field(default_factory=KVSharingStats)
    """This prompt's beams: blocks held vs without sharing, over the steps it decoded."""


# --- the search of one prompt, engine-free ----------------------------------------------------


@dataclass(slots=True, frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float = 0.0
    """Length-penalized; set for finished hypotheses only."""


class BeamGroup:
    """The beam search of one prompt with HF's rules (see the module docstring); no engine here.

    Feed `step()` each running beam's top logprobs; it returns the next running beams as
    (parent index, token) pairs, best first.
    """

    def __init__(self, params: BeamSearchParams, max_tokens: int, eos_token_ids: Iterable[int]) -> None:
        self.params = params
        self.beam_width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * self.beam_width
        self.running: list[Hypothesis] = [Hypothesis((), 0.0)]
        self.finished: list[Hypothesis] = []
        """The best finished hypotheses (at most beam_width), best first."""
        self.num_generated = 0
        self.done = False

    def step(self, top_logprobs: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, int]]:
        """Advance by one token. `top_logprobs[i]`: running beam i's best (token, logprob) pairs,
        at least `num_candidates` of them. Returns the new running beams as (parent index, token)."""
        assert not self.done and len(top_logprobs) == len(self.running)
        k = self.beam_width
        candidates = [
            (beam.cumulative_logprob + logprob, i, token)
            for i, beam in enumerate(self.running)
            for token, logprob in top_logprobs[i][: self.num_candidates]
        ]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep (beam, rank) order
        length = self.num_generated + 1
        at_max = length >= self.max_tokens
        new_finished: list[Hypothesis] = []
        running: list[Hypothesis] = []
        chosen: list[tuple[int, int]] = []
        for rank, (cum, i, token) in enumerate(candidates[: self.num_candidates]):
            if at_max or token in self.eos_token_ids:
                if rank < k:  # only the top k may finish; the rest were spares for the running set
                    tokens = self.running[i].token_ids + (token,)
                    new_finished.append(Hypothesis(tokens, cum, cum / length**self.length_penalty))
            elif len(running) < k:
                running.append(Hypothesis(self.running[i].token_ids + (token,), cum))
                chosen.append((i, token))
        merged = self.finished + new_finished
        merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        self.finished = merged[:k]
        self.running = running
        self.num_generated = length
        self.done = self._is_done()
        if self.done:
            self.running, chosen = [], []
        return chosen

    def _is_done(self) -> bool:
        if not self.running:
            return True
        if len(self.finished) < self.beam_width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_possible = self.running[0].cumulative_logprob / best_length**self.length_penalty
        return not best_possible > self.finished[-1].score


# --- driving the engine core ------------------------------------------------------------------


@dataclass(slots=True)
class _Prompt:
    index: int
    text: str | None
    prompt_token_ids: list[int]
    group: BeamGroup
    core_request: EngineCoreRequest
    num_reserved_blocks: int
    """Blocks its beams could hold at most, without sharing: admission never over-commits the cache."""
    beam_req_ids: list[str] = field(default_factory=list)
    """The core requests of the running beams, in the group's running order."""
    sharing: KVSharingStats = field(default_factory=KVSharingStats)


class BeamSearchRunner:
    """Runs beam search for a batch of prompts on an idle in-process engine (an `LLMEngine`).

    Prompts are admitted while the worst case of their beams (no sharing at all, full length)
    fits the KV cache and max_num_seqs, so no beam is ever preempted: all beams of a prompt
    decode in the same step, which `fork_request` needs.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.core = engine.core
        self.eos_token_ids = list(engine.input_processor.eos_token_ids)
        self._run_id = next(_run_ids)
        self._req_counter = itertools.count()

    def run(self, prompts: Sequence[PromptType],
            params: BeamSearchParams | Sequence[BeamSearchParams]) -> list[BeamSearchOutput]:
        """Search every prompt to the end (one params for all, or one per prompt); outputs in input
        order. Everything is freed on return, also when it raises."""
        if isinstance(params, BeamSearchParams):
            params_list = [params] * len(prompts)
        elif isinstance(params, Sequence):
            params_list = list(params)
        else:
            raise InvalidRequestError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params_list)} beam search params")
        for p in params_list:
            if not isinstance(p, BeamSearchParams):
                raise InvalidRequestError(f"params must be BeamSearchParams, got {type(p).__name__}")
        if self.core.has_unfinished_requests():
            raise RuntimeError("beam search drives the engine core itself; finish the other requests first")
        pending = [self._prepare(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params_list))]
        pending.reverse()  # pop() admits in input order
        active: list[_Prompt] = []
        done: list[_Prompt] = []
        try:
            while pending or active:
                self._admit(pending, active)
                outputs = {out.req_id: out for out in self.core.step()}
                for prompt in list(active):
                    self._advance(prompt, outputs)
                    if prompt.group.done:
                        active.remove(prompt)
                        done.append(prompt)
        finally:
            live = [req_id for prompt in active for req_id in prompt.beam_req_ids]
            if live:
                self.core.abort_requests(live)
        done.sort(key=lambda p: p.index)
        return [self._output(p) for p in done]

    # --- admission ---------------------------------------------------------------------------

    def _prepare(self, index: int, prompt: PromptType, params: BeamSearchParams) -> _Prompt:
        processor = self.engine.input_processor
        text, token_ids = processor.tokenize(prompt)
        room = self.engine.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens, room) if room > 0 else params.max_tokens
        group = BeamGroup(params, max_tokens, self.eos_token_ids)
        if group.num_candidates > MAX_LOGPROBS:
            raise InvalidRequestError(
                f"beam_width {params.beam_width} needs the top {group.num_candidates} logprobs per beam "
                f"({len(group.eos_token_ids)} EOS ids); at most {MAX_LOGPROBS} are available"
            )
        # The core's own pick (greedy, column 0) is ignored; EOS is ours to judge, so ignore_eos.
        sampling_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                         logprobs=group.num_candidates)
        req_id = self._new_req_id(index)
        _, core_request = processor.process(req_id, {"prompt_token_ids": token_ids}, sampling_params)
        blocks_per_beam = cdiv(len(token_ids) + max_tokens, self.core.cache_config.block_size)
        return _Prompt(index, text, token_ids, group, core_request, params.beam_width * blocks_per_beam,
                       beam_req_ids=[req_id])

    def _admit(self, pending: list[_Prompt], active: list[_Prompt]) -> None:
        max_num_seqs = self.core.scheduler_config.max_num_seqs
        while pending:
            prompt = pending[-1]
            num_reserved = sum(p.num_reserved_blocks for p in active) + prompt.num_reserved_blocks
            num_seqs = sum(p.group.beam_width for p in active) + prompt.group.beam_width
            if active and (num_reserved > self.core.num_blocks or num_seqs > max_num_seqs):
                return
            pending.pop()
            self.core.add_request(prompt.core_request)
            active.append(prompt)

    # --- one step ----------------------------------------------------------------------------

    def _advance(self, prompt: _Prompt, outputs: dict) -> None:
        """Choose the prompt's next beams from this step's logprobs; fork them, drop the parents."""
        beam_outputs = [outputs.get(req_id) for req_id in prompt.beam_req_ids]
        for out in beam_outputs:
            if out is not None and out.finish_reason == "abort":
                raise RuntimeError(f"beam request {out.req_id} failed: {out.error or 'aborted'}")
        decoded = [out is not None and bool(out.new_token_ids) for out in beam_outputs]
        if not any(decoded):
            return  # the prompt is still being prefilled (chunked)
        if not all(decoded):
            raise RuntimeError(
                "the beams of one prompt did not decode in the same step (preempted: the KV cache is shared "
                "with other requests?); give the engine more KV memory or run fewer prompts at once"
            )
        top_logprobs = []
        for out in beam_outputs:
            position = out.new_logprobs[0]  # column 0 is the core's greedy pick: skip it
            top_logprobs.append(list(zip(position.token_ids[1:], position.logprobs[1:])))
        chosen = prompt.group.step(top_logprobs)

        parents = prompt.beam_req_ids
        children = []
        for parent_index, token_id in chosen:
            child_id = self._new_req_id(prompt.index)
            self.core.fork_request(parents[parent_index], child_id, token_id)
            children.append(child_id)
        # Children hold their references now; the parents' go (a pruned beam's blocks are free here).
        self.core.abort_requests(parents, RequestStatus.FINISHED_ABORTED)
        prompt.beam_req_ids = children
        if children:
            prompt.sharing.record(*self.core.kv_block_usage(children))

    def _new_req_id(self, index: int) -> str:
        return f"beam-{self._run_id}-{index}-{next(self._req_counter)}"

    def _output(self, prompt: _Prompt) -> BeamSearchOutput:
        tokenizer = self.engine.tokenizer
        group = prompt.group
        params = group.params
        sequences = []
        for hyp in group.finished[: params.num_returned]:
            token_ids = list(hyp.token_ids)
            text = tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens) if tokenizer else ""
            reason = "stop" if token_ids and token_ids[-1] in group.eos_token_ids else "length"
            sequences.append(BeamSequence(token_ids, text, hyp.cumulative_logprob, hyp.score, reason))
        return BeamSearchOutput(prompt.text, prompt.prompt_token_ids, sequences, prompt.sharing)


def beam_search(engine, prompts: Sequence[PromptType],
                params: BeamSearchParams | Sequence[BeamSearchParams]) -> list[BeamSearchOutput]:
    """Beam search for every prompt on an idle `LLMEngine` (one params for all, or one per prompt);
    outputs in input order."""
    return BeamSearchRunner(engine).run(prompts, params)
