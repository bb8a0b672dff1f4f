"""What the sampler knows of one step: each sequence's parameters, packed once into tensors.

The model runner describes each row it samples with a `SamplingRow`; `SamplingMetadata.from_requests`
packs the rows one feature at a time, on the host, so the sampler's device work never waits on Python
lists. A feature no row uses is None, and the sampler skips it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits, and
# the distribution they describe is argmax anyway (vLLM uses the same cut-off).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class RequestTensors:
    """A request's token-indexed sampling data as tensors, built once when the request arrives and
    shared by its sequences: a step gathers these, it never walks a request's dicts or lists."""

    bias_token_ids: torch.Tensor | None
    """[B] int64 token ids of logit_bias (in-vocabulary ones); None without a bias."""
    bias_values: torch.Tensor | None
    """[B] float32 biases, aligned with bias_token_ids."""
    suppressed_token_ids: torch.Tensor | None
    """[S] int64 eos + stop ids, set to -inf while the output is shorter than min_tokens; None when
    min_tokens is 0 or there is nothing to suppress."""

    @classmethod
    def build(cls, params: SamplingParams, eos_token_ids, vocab_size: int, device) -> "RequestTensors":
        """Token ids outside [0, vocab_size) are dropped: the front end validates ids against the vocabulary."""
        bias_ids = bias_values = suppressed = None
        if params.logit_bias:
            pairs = [(t, float(b)) for t, b in params.logit_bias.items() if 0 <= t < vocab_size]
            if pairs:
                bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=device)
                bias_values = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)
        if params.min_tokens > 0:
            ids = sorted({t for t in (*eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab_size})
            if ids:
                suppressed = torch.tensor(ids, dtype=torch.int64, device=device)
        return cls(bias_ids, bias_values, suppressed)


class RequestTensorCache:
    """RequestTensors built once per user request and shared by all of its sequences.

    The sequences of an n > 1 request carry shallow copies of one SamplingParams (same logit_bias
    dict, same stop_token_ids list), so those objects identify the request. Each entry keeps the
    params it was built from (their ids cannot be reused while it lives) and counts its users.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._entries: dict[tuple, list] = {}  # key -> [params, tensors, users]
        self.num_builds = 0

    @staticmethod
    def _key(params: SamplingParams, eos_token_ids: list[int]) -> tuple:
        return id(params.logit_bias), id(params.stop_token_ids), params.min_tokens > 0, tuple(eos_token_ids)

    def acquire(self, params: SamplingParams, eos_token_ids: list[int]) -> RequestTensors:
        entry = self._entries.get(self._key(params, eos_token_ids))
        if entry is None:
            self.num_builds += 1
            tensors = RequestTensors.build(params, eos_token_ids, self.vocab_size, self.device)
            entry = self._entries[self._key(params, eos_token_ids)] = [params, tensors, 0]
        entry[2] += 1
        return entry[1]

    def peek(self, params: SamplingParams, eos_token_ids: list[int]) -> RequestTensors | None:
        entry = self._entries.get(self._key(params, eos_token_ids))
        return entry[1] if entry is not None else None

    def release(self, params: SamplingParams, eos_token_ids: list[int]) -> None:
        key = self._key(params, eos_token_ids)
        entry = self._entries[key]
        entry[2] -= 1
        if entry[2] == 0:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)



def plain_greedy(params: SamplingParams) -> bool:
    """Whether a row of ``params`` samples the argmax of its raw logits with nothing else to report:
    greedy, no logits processor (logit_bias, min_tokens, penalties, a grammar), no logprobs. A batch
    of such rows needs no ``SamplingMetadata`` (the runner's greedy path skips building it)."""
    return (params.temperature < MIN_TEMPERATURE and params.logprobs is None and not params.logit_bias
            and params.min_tokens == 0 and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.structured_outputs is None)


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample a token for in this step."""

    params: SamplingParams
    """The request's sampling parameters."""
    prompt_token_ids: list[int]
    """Prompt tokens (the repetition penalty looks at them)."""
    output_token_ids: list[int]
    """Tokens generated so far (penalties and min_tokens look at them)."""
    generator: torch.Generator | None = None
    """The request's own generator when params.seed is set; the runner keeps it across steps."""
    eos_token_ids: list[int] = field(default_factory=list)
    """End-of-sequence ids, suppressed with stop_token_ids while len(output) < min_tokens."""
    tensors: RequestTensors | None = None
    """The request's prebuilt RequestTensors (the runner keeps them per request); None builds them
    for this step only."""


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step, as tensors; build it with `from_requests`."""

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor
    """[N] float32; 1.0 on greedy rows (never used there)."""
    greedy_mask: torch.Tensor | None
    """[N] bool, True on greedy rows; None when no row is greedy."""
    all_greedy: bool
    top_k: torch.Tensor | None
    """[N] int64, vocab_size where off; None when no row uses top_k."""
    max_top_k: int
    """Largest top_k over the rows that use it (known on the host: no device sync to read it)."""
    top_p: torch.Tensor | None
    """[N] float32, > 1 where off; None when no row uses top_p."""
    min_p: torch.Tensor | None
    """[N] float32; None when no row uses min_p."""
    generators: dict[int, torch.Generator]
    """Row index -> generator, for random (non-greedy) seeded rows only."""
    unseeded_random_rows: torch.Tensor | None
    """[M] int64 row indices of random rows without a generator; None when there are none."""
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """(row indices, token ids, biases), flat; None when no row has a bias."""
    suppressed: tuple[torch.Tensor, torch.Tensor] | None
    """(row indices, token ids) set to -inf for min_tokens; None when nothing is suppressed."""
    output_counts: torch.Tensor | None
    """[N, vocab_size] float32 counts of each generated token; None when no row has penalties."""
    prompt_mask: torch.Tensor | None
    """[N, vocab_size] bool, token occurs in the prompt; None when no row has a repetition penalty."""
    presence_penalty: torch.Tensor | None
    """[N] float32; None when no row has penalties (likewise the next two)."""
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    max_num_logprobs: int | None
    """Largest `logprobs` over the rows; None when no row asks for logprobs."""
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None
    """Structured outputs: ([N, ceil(V/32)] int32 bitmask, bit set = token allowed; the row indices it
    applies to). None when no row is constrained."""

    @property
    def has_logits_processors(self) -> bool:
        """Whether logit_bias, min_tokens suppression, a penalty or a grammar rewrites some row's logits."""
        return (self.logit_bias is not None or self.suppressed is not None or self.output_counts is not None
                or self.token_bitmask is not None)

    @classmethod
    def from_requests(cls, rows: list[SamplingRow], vocab_size: int, device) -> "SamplingMetadata":
        """Pack the rows' parameters into tensors on `device`, one feature at a time.

        Token ids outside [0, vocab_size) in logit_bias, stop_token_ids or eos ids are ignored
        here: the front end validates request token ids against the vocabulary.
        """
        params = [row.params for row in rows]
        tensors = [row.tensors if row.tensors is not None
                   else RequestTensors.build(row.params, row.eos_token_ids, vocab_size, device) for row in rows]
        greedy = [p.temperature < MIN_TEMPERATURE for p in params]
        top_k, max_top_k = _top_k(params, greedy, vocab_size, device)
        generators, unseeded_random_rows = _noise_sources(rows, greedy, device)
        output_counts, prompt_mask, presence, frequency, repetition = _penalties(rows, vocab_size, device)
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            temperature=_temperature(params, greedy, device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device) if any(greedy) else None,
            all_greedy=all(greedy),
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=_top_p(params, greedy, device),
            min_p=_min_p(params, greedy, device),
            generators=generators,
            unseeded_random_rows=unseeded_random_rows,
            logit_bias=_logit_bias(tensors, device),
            suppressed=_min_tokens_suppression(rows, tensors, device),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
        )


# Packing, one feature each. `greedy[i]` marks rows sampled by argmax: truncation and noise skip them.


def _temperature(params: list[SamplingParams], greedy: list[bool], device) -> torch.Tensor:
    """[N] float32; 1.0 on greedy rows, whose logits are never divided."""
    values = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
    return torch.tensor(values, dtype=torch.float32, device=device)


def _top_k(params: list[SamplingParams], greedy: list[bool], vocab_size: int, device) -> tuple[torch.Tensor | None, int]:
    """([N] int64 with vocab_size where off, the largest k), or (None, vocab_size) when no random row truncates."""
    if not any(not g and p.top_k is not None and p.top_k < vocab_size for p, g in zip(params, greedy)):
        return None, vocab_size
    ks = [vocab_size if g or p.top_k is None else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
    return torch.tensor(ks, dtype=torch.int64, device=device), max(ks)


def _top_p(params: list[SamplingParams], greedy: list[bool], device) -> torch.Tensor | None:
    if not any(not g and p.top_p < 1.0 for p, g in zip(params, greedy)):
        return None
    # 2.0 switches top_p off exactly: float32 cumulative sums can exceed 1.0.
    values = [2.0 if g or p.top_p >= 1.0 else p.top_p for p, g in zip(params, greedy)]
    return torch.tensor(values, dtype=torch.float32, device=device)


def _min_p(params: list[SamplingParams], greedy: list[bool], device) -> torch.Tensor | None:
    if not any(not g and p.min_p > 0.0 for p, g in zip(params, greedy)):
        return None
    return torch.tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)], dtype=torch.float32, device=device)


def _noise_sources(rows: list[SamplingRow], greedy: list[bool],
                   device) -> tuple[dict[int, torch.Generator], torch.Tensor | None]:
    """Where each random row's noise comes from: its own generator (seeded) or one shared draw."""
    generators: dict[int, torch.Generator] = {}
    unseeded: list[int] = []
    for i, (row, g) in enumerate(zip(rows, greedy)):
        if g:
            continue
        if row.generator is not None:
            generators[i] = row.generator
        else:
            unseeded.append(i)
    return generators, (torch.tensor(unseeded, dtype=torch.int64, device=device) if unseeded else None)


def _logit_bias(tensors: list[RequestTensors],
                device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Flat (row, token, bias) triples, concatenated from the rows' prebuilt tensors; None when no row has a bias."""
    with_bias = [(i, t) for i, t in enumerate(tensors) if t.bias_token_ids is not None]
    if not with_bias:
        return None
    return (
        _row_indices([i for i, _ in with_bias], [t.bias_token_ids.numel() for _, t in with_bias], device),
        torch.cat([t.bias_token_ids for _, t in with_bias]),
        torch.cat([t.bias_values for _, t in with_bias]),
    )


def _min_tokens_suppression(rows: list[SamplingRow], tensors: list[RequestTensors],
                            device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs to set to -inf: eos + stop ids of rows short of min_tokens."""
    short = [(i, t.suppressed_token_ids) for i, (row, t) in enumerate(zip(rows, tensors))
             if t.suppressed_token_ids is not None and len(row.output_token_ids) < row.params.min_tokens]
    if not short:
        return None
    return (_row_indices([i for i, _ in short], [ids.numel() for _, ids in short], device),
            torch.cat([ids for _, ids in short]))


def _row_indices(row_ids: list[int], counts: list[int], device) -> torch.Tensor:
    """[sum(counts)] int64: row_ids[j] repeated counts[j] times (built on the host: no device sync)."""
    return torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.int64),
                                   torch.tensor(counts, dtype=torch.int64)).to(device)


def _penalties(rows: list[SamplingRow], vocab_size: int, device) -> tuple[torch.Tensor | None, ...]:
    """(output_counts, prompt_mask, presence, frequency, repetition); the [N, V] tensors are built only
    when some row needs them, and the prompt mask only for a repetition penalty."""
    params = [row.params for row in rows]
    any_rep = any(p.repetition_penalty != 1.0 for p in params)
    if not any_rep and not any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        return None, None, None, None, None
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
    output_counts = _token_counts([row.output_token_ids for row in rows], vocab_size, device)
    prompt_mask = _token_counts([row.prompt_token_ids for row in rows], vocab_size, device) > 0 if any_rep else None
    return output_counts, prompt_mask, presence, frequency, repetition


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[N, vocab_size] float32 occurrence counts, via one scatter_add over the flattened ids."""
    num_rows = len(token_lists)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device=device)
    flat = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
    # Out-of-vocabulary ids land in an extra column that is dropped.
    flat = torch.where((flat >= 0) & (flat < vocab_size), flat, vocab_size)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.view(-1).scatter_add_(0, rows * (vocab_size + 1) + flat, torch.ones_like(flat, dtype=torch.float32))
    return counts[:, :vocab_size]
