"""Beam search inside the engine core: a beam group is one request whose beams are core requests.

A request with `use_beam_search` becomes a `BeamGroup`. Its beams are ordinary core requests
(greedy rows asking for the top K logprobs; the core's own pick is ignored) that run in the same
batches as every other request. After each step in which the group's beams sampled, the group
chooses the next beams with Hugging Face's rules (`BeamSelection`), and each chosen (parent,
token) becomes a child forked copy-on-write from its parent; the parents are finished, so a
pruned beam's blocks are free at once (`Scheduler.replace_beams`, called by the engine core with
what `BeamGroups.update` decided: core/beam_registry.py).

    step t:   beams P, Q (P's last token computed now) -> top-K logprobs of P and Q
              -> HF selection -> (P, a), (P, b), (Q, c)
              -> fork P->A(last=a), P->B(last=b), Q->C(last=c) in P's place; finish P, Q
    step t+1: A, B, C each compute their last token (A or B copies the shared partial block)

The scheduler keeps the beams of a group together (`Request.beam_group_id`): they are scheduled
in the same step or not at all, no beam samples unless all of them do, and a group is preempted
and resumed as a whole (`Scheduler`, asking core/beam_gang.py).

HF `_beam_search` conventions (greedy), matched exactly:

- Candidates. Each step takes the top K = max(2, 1 + number of EOS ids) * k continuations over
  all beams by cumulative logprob (the raw log_softmax of the model's logits, summed). At the
  first step only the prompt is a beam. With ignore_eos there are no EOS ids (HF:
  eos_token_id=None) and EOS is an ordinary token, so K = 2k.
- A candidate "finishes" when its token is an EOS id or it reaches max_tokens. Only finishing
  candidates ranked among the top k of the K become finished hypotheses; the others are dropped.
  The next step's beams are the best k candidates that do not finish, in rank order.
- Score of a finished hypothesis: cumulative logprob / L ** length_penalty, where L is its
  generated length including the EOS token (the prompt is not counted). This is HF's
  `sequences_scores`. A group keeps the k best finished hypotheses.
- Early stopping, checked after each step once k hypotheses are finished:
    False    stop when best running beam's cumulative logprob / t ** length_penalty (t = tokens
             generated so far) is not above the worst kept finished score; HF's heuristic, which
             can be wrong when length_penalty > 0 favours longer beams;
    "never"  the same, but with t = max_tokens when length_penalty > 0 (exact bound);
    True     stop as soon as k hypotheses are finished.
  Every group stops at max_tokens at the latest.
- Output: the best n finished hypotheses, best score first, token_ids including the final EOS.

Streaming: a group reports nothing until it finishes, then each returned beam's whole text at
once. The best running beam can lose its lead at any later step (and most beams are pruned), so
streaming partial beams would mean retracting text already sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedllm.core.request import EngineCoreRequest, Request
from pagedllm.core.sched_output import EngineCoreOutput, TokenLogprobs
from pagedllm.errors import InvalidRequestError
from pagedllm.request_limits import MAX_LOGPROBS
from pagedllm.sampling_params import SamplingParams


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


@dataclass(slots=True, frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float = 0.0
    """Length-penalized; set for finished hypotheses only."""
    logprobs: tuple[float, ...] = ()
    """The logprob of each token (their running sum is cumulative_logprob)."""
    ranks: tuple[int, ...] = ()
    """Each token's rank among its parent's candidates (1 = the most likely)."""


class BeamSelection:
    """The beam search of one prompt with HF's rules (see the module docstring); no engine here.

    Feed `step()` each running beam's top logprobs; it returns the next running beams as
    (parent index, token) pairs, best first.
    """

    def __init__(self, beam_width: int, max_tokens: int, eos_token_ids: Iterable[int],
                 length_penalty: float = 1.0, early_stopping: bool | str = False) -> None:
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * beam_width
        self.running: list[Hypothesis] = [Hypothesis((), 0.0)]
        self.finished: list[Hypothesis] = []
        """The best finished hypotheses (at most beam_width), best first."""
        self.num_generated = 0
        self.done = False

    def step(self, top_logprobs: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, int]]:
        """Advance by one token. `top_logprobs[i]`: running beam i's best (token, logprob) pairs,
        most likely first, at least `num_candidates` of them. Returns the new running beams as
        (parent index, token)."""
        assert not self.done and len(top_logprobs) == len(self.running)
        k = self.beam_width
        candidates = [
            (beam.cumulative_logprob + logprob, i, token, logprob, rank)
            for i, beam in enumerate(self.running)
            for rank, (token, logprob) in enumerate(top_logprobs[i][: self.num_candidates], start=1)
        ]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep (beam, rank) order
        length = self.num_generated + 1
        at_max = length >= self.max_tokens
        new_finished: list[Hypothesis] = []
        running: list[Hypothesis] = []
        chosen: list[tuple[int, int]] = []
        for position, (cum, i, token, logprob, rank) in enumerate(candidates[: self.num_candidates]):
            parent = self.running[i]
            if at_max or token in self.eos_token_ids:
                if position < k:  # only the top k may finish; the rest were spares for the running set
                    new_finished.append(Hypothesis(parent.token_ids + (token,), cum, cum / length**self.length_penalty,
                                                   parent.logprobs + (logprob,), parent.ranks + (rank,)))
            elif len(running) < k:
                running.append(Hypothesis(parent.token_ids + (token,), cum, 0.0,
                                          parent.logprobs + (logprob,), parent.ranks + (rank,)))
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


def beam_row_params(num_candidates: int, max_tokens: int) -> SamplingParams:
    """What a beam's core request samples with: greedy (the pick is ignored), the top candidates'
    logprobs, and EOS left to the group to judge."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=num_candidates)


class BeamGroup:
    """One beam-search request in the core: its selection, its live beams and what it reports.

    The beams' core request ids are `beam:<req_id>:<counter>`; the front end never sees them.
    It hears of the group once, when it finishes, under the request's own sequence ids.
    """

    def __init__(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        assert params.use_beam_search
        self.request = request
        self.output_ids = params.sequence_req_ids(request.req_id)
        """The front end's sequence ids: the i-th best beam is reported as output_ids[i]."""
        eos = () if params.ignore_eos else request.eos_token_ids
        self.selection = BeamSelection(params.num_sequences, request.max_tokens, eos,
                                       params.length_penalty, params.early_stopping)
        if self.selection.num_candidates > MAX_LOGPROBS:
            raise InvalidRequestError(
                f"a beam width of {params.num_sequences} needs the top {self.selection.num_candidates} logprobs "
                f"per beam ({len(self.selection.eos_token_ids)} EOS ids); at most {MAX_LOGPROBS} are available: "
                f"lower max(n, best_of)"
            )
        self.row_params = beam_row_params(self.selection.num_candidates, request.max_tokens)
        self.beam_req_ids: list[str] = []
        """The core requests of the running beams, in the selection's running order."""
        self.sharing = KVSharingStats()
        self.num_cached_tokens = 0
        self._counter = 0

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def beam_width(self) -> int:
        return self.selection.beam_width

    def new_beam_id(self) -> str:
        self._counter += 1
        return f"beam:{self.req_id}:{self._counter}"

    def first_beam(self) -> Request:
        """The prompt as the group's only beam (the scheduler computes it like any prompt)."""
        req = self.request
        beam = Request(self.new_beam_id(), list(req.prompt_token_ids), self.row_params, frozenset(req.eos_token_ids),
                       req.max_tokens, req.arrival_time, req.cache_salt, priority=req.priority, lora_request=req.lora_request,
                       beam_group_id=self.req_id)
        self.beam_req_ids = [beam.req_id]
        return beam

    def step(self, beam_outputs: Sequence[EngineCoreOutput]) -> list[tuple[int, str, int]]:
        """Choose the next beams from this step's outputs (one per running beam, in order).

        Returns the children to fork as (parent index, child id, token); empty once done.
        """
        top_logprobs = []
        for out in beam_outputs:
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            position = out.new_logprobs[0]  # column 0 is the core's greedy pick: skip it
            top_logprobs.append(list(zip(position.token_ids[1:], position.logprobs[1:])))
        chosen = self.selection.step(top_logprobs)
        return [(parent, self.new_beam_id(), token) for parent, token in chosen]

    @property
    def done(self) -> bool:
        return self.selection.done

    def final_outputs(self) -> list[EngineCoreOutput]:
        """The best n beams, best first, each as one finished output with all of its tokens."""
        eos = self.selection.eos_token_ids
        outputs = []
        for out_id, hyp in zip(self.output_ids, self.selection.finished):
            token_ids = list(hyp.token_ids)
            logprobs = [TokenLogprobs([t], [lp], rank) for t, lp, rank in zip(token_ids, hyp.logprobs, hyp.ranks)]
            reason = "stop" if token_ids and token_ids[-1] in eos else "length"
            outputs.append(EngineCoreOutput(out_id, token_ids, new_logprobs=logprobs, finish_reason=reason,
                                            num_cached_tokens=self.num_cached_tokens))
        return outputs

    def failed_outputs(self, error: str | None) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(out_id, [], finish_reason="abort", error=error) for out_id in self.output_ids]
