"""The contracts between scheduler and runner, and from the core to the front end: plain data, ids and integers,
a new request's data sent once (the scheduler builds them: `Scheduler._new_request_data`, `StepBuilder` in
core/admission.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: new, or resumed after preemption."""

    req_id: str
    token_ids: list[int]
    """Every known token: the prompt, plus the output so far for a resumed request."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the blocks (prefix-cache hits)."""
    eos_token_ids: frozenset[int] = frozenset()
    fork_children: list[tuple[str, SamplingParams]] = field(default_factory=list)
    """Parallel samples to draw from this request's first sampling logits, one row each."""
    lora_request: LoRARequest | None = None
    """The adapter the request generates with; None = the base model."""
    pooling_params: PoolingParams | None = None
    """A pooling request: its last prompt chunk returns the pooled vector instead of a sampled token."""


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already knows: only what changed. The runner applies the fields in
    order: cut its block table to `num_kept_block_ids`, replace, append `new_block_ids`."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is in the blocks before this step: the runner takes it as is."""
    replaced_block_ids: dict[int, int] = field(default_factory=dict)
    """Block-table index -> new id: copy-on-write's private block for a shared one, or the null block for one
    freed behind a sliding window (core/kv_cache_manager.py)."""
    num_kept_block_ids: int | None = None
    """After a speculative step: the block table's length once the blocks holding only rejected
    proposals were freed (core/spec_planner.py); None when nothing was rolled back."""


@dataclass(slots=True)
class SchedulerOutput:
    """One step: which requests run, and how many of their tokens."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """req_id -> tokens to compute this step. Prefill, chunk and decode alike."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or aborted since the last step: the runner drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the runner drops their blocks; they return as new."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) block copies the runner applies before the forward pass (copy-on-write)."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block) copies, made first: the device blocks may be reused this step."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block) copies, made after swap_out and before the forward pass."""
    kv_spill: list[int] = field(default_factory=list)
    """Blocks whose K/V the runner copies out first (evicted this step, kept by the disk tier)."""
    kv_load: list[tuple[int, bytes]] = field(default_factory=list)
    """(block, K/V bytes read from disk) written after swap_out and before swap_in (core/kv_disk_tier.py)."""
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> speculative proposals, scheduled after the request's last token and counted in
    num_scheduled_tokens (1 + len(proposals)). The runner scores every position and returns the
    accepted prefix plus one token of its own (core/spec_planner.py)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """req_id -> proposals the runner's draft model makes this step (method 'draft_model'): scheduled like
    `scheduled_spec_tokens` (1 + k slots in num_scheduled_tokens), their ids known only to the runner,
    which reports them in ModelRunnerOutput.spec_token_ids."""
    draft_keep_up: bool = True
    """Method 'draft_model': the runner's draft also runs over this step's prompt chunks, so its KV keeps
    up with the target's. False while the engine-wide gate (core/spec_planner.py) finds the draft seldom
    right: the draft then runs only for the requests in num_draft_tokens (none while the gate is
    closed), each catching its draft KV up when it proposes (worker/draft_proposer.py)."""


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one position: column 0 is the chosen token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int
    """Rank of the chosen token in the model's distribution (1 = most likely)."""


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, per request that sampled."""

    sampled_token_ids: dict[str, list[int]]
    """req_id -> tokens sampled this step (absent while a prompt is still being computed)."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    """req_id -> logprobs of the prompt positions computed this step (None for the first token)."""
    failed: dict[str, str] = field(default_factory=dict)
    """req_id -> error message, for requests that failed alone; the others carry on."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> the proposals the draft model made for SchedulerOutput.num_draft_tokens (what was scored)."""
    kv_spilled: list[bytes] = field(default_factory=list)
    """The K/V bytes of SchedulerOutput.kv_spill's blocks, in its order."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """req_id -> the pooled vector of a pooling request whose last prompt chunk ran this step."""


@dataclass(slots=True)
class EngineCoreOutput:
    """What the front end learns about one request after a step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    """'stop', 'length' or 'abort' once finished; None while running."""
    stop_reason: int | str | None = None
    """The stop token id that ended the request, if any."""
    error: str | None = None
    """Set when this request failed alone; finish_reason is then 'abort'."""
    num_cached_tokens: int = 0
    queue_time: float | None = None
    """Seconds from arrival to first admission, on the request's first output only (metrics)."""
    pooled: list[float] | None = None
    """A pooling request's vector, on its one (finished) output."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
