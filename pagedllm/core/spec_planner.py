"""Speculative decoding, the scheduler's side: plan before the step, settle after.

`SpecDecoder.plan` decides, per request, what it proposes this step (n-gram token ids, or a number
of draft-model slots); `SpecDecoder.settle` counts what the runner kept and says where the request's
computed tokens roll back to. The rollback is computed there once: the scheduler trims the blocks and
tells the runner the block table's new length (`CachedRequestData.num_kept_block_ids`).

A running request at decode may carry up to k proposed tokens. They are scheduled like prompt
tokens after its last sampled token, so one forward pass scores all k + 1 positions:

    all_token_ids:  [ ...... computed ...... | t ]           t: sampled last step, KV not yet computed
    scheduled:                               [ t | d1 d2 d3 ]   d: proposals (never in all_token_ids)
    runner returns:                              [ d1 d2 | b ]  accepted prefix + one token of its own
    after the step: num_computed_tokens = num_tokens - 1        (the KV of t, d1, d2 is kept; d3's
                                                                  slot is rolled back and rewritten later)

Proposals never enter `all_token_ids`, so prefix-cache hashing only ever covers real tokens.
Pure Python (no torch): proposers here must be cheap per step. A draft model (method 'draft_model')
runs in the worker instead (worker/draft_proposer.py): the scheduler then reserves the k slots
(`SchedulerOutput.num_draft_tokens`) and learns the proposals from the runner's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.config import SpeculativeConfig
from pagedllm.core.admission import StepBuilder
from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in its own tokens (longest n first,
    latest occurrence) and propose the tokens that followed them there.

    Each request keeps an index {n-gram: end of its latest occurrence}, extended only with the tokens
    that arrived since the last call, so a proposal costs O(new tokens x n-gram lengths), not a scan.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[str, dict[tuple[int, ...], int]] = {}
        self._num_indexed: dict[str, int] = {}
        """req_id -> exclusive end of the last n-gram ends indexed (the index covers ends < this)."""

    def propose(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        num_tokens = len(token_ids)
        index = self._index.setdefault(req_id, {})
        # Index every n-gram ending before the last token (a match must have a continuation).
        start = self._num_indexed.get(req_id, 1)
        for end in range(max(start, 1), num_tokens):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(token_ids[end - n:end])] = end
        self._num_indexed[req_id] = max(start, num_tokens)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            end = index.get(tuple(token_ids[num_tokens - n:]))
            if end is not None:
                return token_ids[end:end + k]
        return []

    def forget(self, req_id: str) -> None:
        self._index.pop(req_id, None)
        self._num_indexed.pop(req_id, None)


@dataclass(slots=True)
class _Backoff:
    """Per request: how many proposals it is worth scoring, and how long to pause after failures.

    A scored proposal is not free once a step is no longer bound by reading the weights (batch 16
    on the CPU): each costs about a token of compute. So a request proposes about one more token than
    it has recently kept (`mean_accepted`, halved towards each step's count), and a request whose
    proposals keep failing skips proposing for 3, 7, ... 63 steps.
    """

    mean_accepted: float
    acceptance: float | None = None
    """Recent fraction of proposals kept (halved towards each step's); None before the first."""
    num_failures: int = 0
    skip_steps: int = 0
    probe_due: bool = False
    """After a pause for low acceptance: propose once whatever the acceptance (a probe)."""


FLAT_BATCH_SIZE = 4
"""The batch size at which a step's per-token compute costs about as much as its fixed part (reading
the weights). A proposal costs a token of compute and pays off only if it is kept, so at batch B a
request speculates only while it keeps more than B / (B + FLAT_BATCH_SIZE) of its proposals (20% at
batch 1, 50% at 4, 80% at 16). Measured on the default model on a 2-core CPU (`pagedllm bench
speculative`): a 5-token step cost ~1.8x a 1-token step at batch 1, and at batch 16 the Alpaca-like
trace (acceptance ~0.5) ran 9% slower with a 50% bar; copy-heavy requests (~0.9) keep speculating."""
PROBE_INTERVAL = 8
"""A request below that bar proposes again after this many steps, to see whether its text changed."""


MAX_BACKOFF_EXPONENT = 6
"""A request whose proposals keep failing pauses for at most 2**6 - 1 steps."""
MAX_GATE_INTERVAL = 64
"""The draft gate stays closed for at most this many steps at a time."""
GATE_MAX_BAR = 0.5
"""The draft gate never asks for more than half of the proposals kept."""


@dataclass(slots=True)
class _DraftGate:
    """Engine-wide backoff for a draft model, on top of the per-request one.

    A draft pass costs a read of the draft's weights (its LM head alone is 28M parameters for the
    default vocabulary) whether one request speculates or sixteen: with per-request backoff only,
    some request probes at nearly every step, so a draft that is seldom right ran every step and
    cost 13-21% at batch 4-16 (`pagedllm bench speculative --methods draft_model`). So when the
    acceptance of recent proposals, engine-wide, falls below the bar (B/(B+4), at most one half),
    no request proposes for 8
    steps, then 16, ... 64 while it stays below; one step that clears the bar resets the interval.
    While the last decision stands below the bar, the steps let through are probes: one proposal
    per request, and the draft runs over nothing else (its KV lags; worker/draft_proposer.py).
    """

    acceptance: float | None = None
    """Recent acceptance over all requests (halved towards each step's pooled rate: one request's
    0-or-1 outcome alone is too noisy to stop a whole batch)."""
    num_proposed: int = 0
    num_accepted: int = 0
    """Scored and kept since the last decision."""
    closed_steps: int = 0
    interval: int = PROBE_INTERVAL
    below_bar: bool = False
    """The last decision found the acceptance below the bar: while it stands, the steps the gate lets
    through are probes (one proposal per request, no draft pass over prompts)."""

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted

    def is_open(self, batch_size: int) -> bool:
        """Decide this step (call once per step)."""
        if self.closed_steps > 0:
            self.closed_steps -= 1
            return False
        if self.num_proposed:
            rate = self.num_accepted / self.num_proposed
            self.num_proposed = self.num_accepted = 0
            self.acceptance = rate if self.acceptance is None else 0.5 * self.acceptance + 0.5 * rate
            # The per-request bar (B/(B+4)) already prices each proposal's compute; the gate is for
            # drafts that are mostly wrong, so it never asks for more than half kept.
            self.below_bar = self.acceptance < min(GATE_MAX_BAR, batch_size / (batch_size + FLAT_BATCH_SIZE))
            if self.below_bar:
                self.closed_steps = self.interval - 1
                self.interval = min(2 * self.interval, MAX_GATE_INTERVAL)
                return False
            self.interval = PROBE_INTERVAL
        return True


@dataclass
class SpecDecodeStats:
    """Cumulative counters of speculative decoding (only grow)."""

    num_spec_steps: int = 0
    """Request-steps that carried proposals."""
    num_draft_tokens: int = 0
    """Tokens proposed and scored."""
    num_accepted_tokens: int = 0
    """Proposals the model agreed with (kept)."""
    num_bonus_tokens: int = 0
    """Tokens the model added after the accepted prefix, in request-steps with proposals."""
    accepted_per_position: list[int] = field(default_factory=list)
    """[j]: how often the proposal at position j (0-based) was accepted."""
    proposed_per_position: list[int] = field(default_factory=list)
    """[j]: how often a proposal at position j was scored."""

    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True, slots=True)
class SpecPlan:
    """What one request proposes this step; at most one of the two is non-empty."""

    proposals: list[int]
    """n-gram proposals (SchedulerOutput.scheduled_spec_tokens)."""
    num_draft_tokens: int = 0
    """Slots for the runner's draft model to fill (SchedulerOutput.num_draft_tokens)."""

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past the request's last token that the step scores."""
        return len(self.proposals) or self.num_draft_tokens


NO_PROPOSALS = SpecPlan([])


class SpecDecoder:
    """The scheduler's collaborator: proposals for requests at decode, backoff, and the counters.

    'ngram' proposes here (token ids in SchedulerOutput.scheduled_spec_tokens); 'draft_model' only
    decides how many tokens to propose (SchedulerOutput.num_draft_tokens): the runner's draft model
    makes them at the start of the step that scores them and reports them back. Backoff is the same.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        self._backoff: dict[str, _Backoff] = {}
        self._gate = _DraftGate() if self.proposer is None else None
        self._step_open = True
        k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k, proposed_per_position=[0] * k)

    @property
    def proposes_in_worker(self) -> bool:
        """True when the runner (its draft model) makes the proposals, the scheduler only counts them."""
        return self.proposer is None

    @property
    def step_open(self) -> bool:
        """False while the draft model's gate stops every proposal this step."""
        return self._step_open

    @property
    def keeps_draft_up(self) -> bool:
        """Whether the runner's draft runs over this step's prompt chunks too (SchedulerOutput.draft_keep_up):
        not while the gate finds it seldom right, whose KV then catches up only when a request proposes."""
        return self._gate is None or (self._step_open and not self._gate.below_bar)

    def begin_step(self, batch_size: int) -> None:
        """Called once per scheduled step, before any `num_to_propose`: the draft model's gate."""
        self._step_open = self._gate is None or self._gate.is_open(batch_size)

    def plan(self, request: Request, token_budget: int, batch_size: int, max_model_len: int,
             has_waiting_samples: bool) -> SpecPlan:
        """What `request` proposes this step: nothing for beams, structured outputs (the runner verifies
        proposals without the grammar's mask), a prompt still computing or a leader whose parallel
        samples still wait for its first token; never past max_tokens / max_model_len (the accepted
        tokens plus the bonus must fit both) or the step's `token_budget`. Call once per request-step
        (it counts backoff); `batch_size`: the requests running this step (see FLAT_BATCH_SIZE)."""
        if (request.beam_group_id is not None or request.sampling_params.structured_outputs is not None
                or request.num_tokens - request.num_computed_tokens != 1 or has_waiting_samples):
            return NO_PROPOSALS
        max_k = min(token_budget - 1, request.max_tokens - request.num_output_tokens - 1,
                    max_model_len - request.num_tokens - 1)
        if self.proposes_in_worker:
            return SpecPlan([], self.num_to_propose(request.req_id, max_k, batch_size))
        return SpecPlan(self.propose(request.req_id, request.all_token_ids, max_k, batch_size))

    def allocate(self, kv: KVCacheManagerProtocol, request: Request, num_new_tokens: int, plan: SpecPlan,
                 step: StepBuilder) -> list[int] | None:
        """Blocks for the request's `num_new_tokens` and the plan's proposals, whose tokens (or draft slots)
        are entered into `step`; None, with nothing entered, if they do not fit. Speculation never
        preempts: without room the request runs plainly."""
        if not plan.num_lookahead_tokens:
            return None
        new_block_ids = kv.allocate_slots(request, num_new_tokens, num_lookahead_tokens=plan.num_lookahead_tokens)
        if new_block_ids is not None:
            if plan.proposals:
                step.scheduled_spec_tokens[request.req_id] = plan.proposals
            else:
                step.num_draft_tokens[request.req_id] = plan.num_draft_tokens
        return new_block_ids

    def settle(self, request: Request, sched_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> int | None:
        """After a step: if it scored proposals of `request` (n-gram ones from `sched_output`, draft ones
        reported in `runner_output`), count what was kept and return the computed count the request
        rolls back to; None if it scored none, or the request finished (its blocks are freed whole).

        The runner returned the kept prefix plus one token of the model's own, already appended to
        `request`. The KV of the last token and of the kept proposals stays; the rejected positions are
        uncomputed again: num_computed_tokens = num_tokens - 1 (see the diagram above)."""
        req_id = request.req_id
        proposals = (runner_output.spec_token_ids[req_id] if req_id in sched_output.num_draft_tokens
                     else sched_output.scheduled_spec_tokens.get(req_id))
        if proposals is None:
            return None
        new_token_ids = runner_output.sampled_token_ids[req_id]
        num_accepted = len(new_token_ids) - 1
        assert 0 <= num_accepted <= len(proposals) and new_token_ids[:num_accepted] == proposals[:num_accepted]
        self.record(req_id, len(proposals), num_accepted, len(new_token_ids))
        return None if request.is_finished else request.num_tokens - 1

    def propose(self, req_id: str, token_ids: list[int], max_k: int, batch_size: int = 1) -> list[int]:
        """At most min(k, max_k) proposals for a request whose only uncomputed token is its last;
        `batch_size`: the requests running this step (see FLAT_BATCH_SIZE). ngram only."""
        assert self.proposer is not None, "draft_model proposals are made by the runner"
        k = self.num_to_propose(req_id, max_k, batch_size)
        return self.proposer.propose(req_id, token_ids, k) if k > 0 else []

    def num_to_propose(self, req_id: str, max_k: int, batch_size: int = 1) -> int:
        """How many tokens the request should propose this step (0: none), after backoff; counts a
        skipped step, so call it once per request-step."""
        k = min(self.config.num_speculative_tokens, max_k)
        if k <= 0 or not self._step_open:  # a closed gate leaves the per-request backoff as it was
            return 0
        if self._gate is not None and self._gate.below_bar:
            k = 1  # a probe of a draft seldom right: one proposal each tells the gate as much, for less
        backoff = self._backoff.get(req_id)
        if backoff is not None:
            if backoff.skip_steps > 0:
                backoff.skip_steps -= 1
                return 0
            if backoff.probe_due:
                backoff.probe_due = False
            elif backoff.acceptance is not None and backoff.acceptance < batch_size / (batch_size + FLAT_BATCH_SIZE):
                backoff.skip_steps = PROBE_INTERVAL - 1
                backoff.probe_due = True
                return 0
            k = min(k, 1 + int(backoff.mean_accepted + 0.5))
        return k

    def record(self, req_id: str, num_proposed: int, num_accepted: int, num_new_tokens: int) -> None:
        """A step scored `num_proposed` proposals of `req_id`, kept `num_accepted`, appended `num_new_tokens`."""
        stats = self.stats
        stats.num_spec_steps += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        stats.num_bonus_tokens += max(0, num_new_tokens - num_accepted)
        for j in range(num_proposed):
            stats.proposed_per_position[j] += 1
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1
        backoff = self._backoff.get(req_id)
        if backoff is None:
            backoff = self._backoff[req_id] = _Backoff(mean_accepted=float(self.config.num_speculative_tokens))
        # A proposal cut short by max_tokens or the lookup says little: count a full run as k kept.
        kept = self.config.num_speculative_tokens if num_accepted == num_proposed else num_accepted
        backoff.mean_accepted = 0.5 * backoff.mean_accepted + 0.5 * kept
        rate = num_accepted / num_proposed if num_proposed else 0.0
        if self._gate is not None:
            self._gate.observe(num_proposed, num_accepted)
        backoff.acceptance = rate if backoff.acceptance is None else 0.5 * backoff.acceptance + 0.5 * rate
        if num_accepted == 0:
            backoff.num_failures = min(backoff.num_failures + 1, MAX_BACKOFF_EXPONENT)
            backoff.skip_steps = (1 << backoff.num_failures) - 1 if backoff.num_failures > 1 else 0
        else:
            backoff.num_failures = 0

    def forget(self, req_id: str) -> None:
        if self.proposer is not None:
            self.proposer.forget(req_id)
        self._backoff.pop(req_id, None)
