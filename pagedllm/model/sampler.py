"""Turn one step's logits into sampled tokens (and logprobs), one row per sequence.

The sampler knows nothing of scheduling: the model runner describes each row it samples with a
`SamplingRow`, packs them once per step into a `SamplingMetadata` of tensors, and calls `Sampler`.

Processing order for every row (vLLM's, which users know):

    raw logits ──► logprobs / ranks reported to the user (log_softmax of the raw logits)
        │
        ├─ logit_bias
        ├─ min_tokens: eos + stop_token_ids to -inf while len(output) < min_tokens
        ├─ penalties: repetition (prompt + output), frequency and presence (output only)
        ├─ structured outputs: tokens the row's grammar forbids to -inf (one bitmask op)
        │
        ├─ greedy rows ─────────────────────────────────────► argmax
        └─ random rows: / temperature ─► top_k ─► top_p ─► min_p ─► inverse-CDF draw

Random rows draw one uniform number each: from their own `torch.Generator` when the request has a
seed, so a seeded request's tokens depend on nothing else in the batch; unseeded rows share one draw
from the default generator. Greedy rows draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits, and
# the distribution they describe is argmax anyway (vLLM uses the same cut-off).
_MIN_TEMPERATURE = 1e-5


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
        greedy = [p.temperature < _MIN_TEMPERATURE for p in params]
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


@dataclass(slots=True)
class SamplerOutput:
    """One step's sampled tokens, and logprobs when some row asked for them."""

    sampled_token_ids: torch.Tensor
    """[N] int64."""
    logprob_token_ids: torch.Tensor | None
    """[N, 1 + max_num_logprobs] int64: column 0 the sampled token, then the top ids (most likely first)."""
    logprobs: torch.Tensor | None
    """[N, 1 + max_num_logprobs] float32, the raw model logprobs of logprob_token_ids."""
    sampled_token_ranks: torch.Tensor | None
    """[N] int64: rank of the sampled token in the raw distribution (1 = most likely)."""


class Sampler(nn.Module):
    """Logits [N, V] + SamplingMetadata -> SamplerOutput. Stateless."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_rows
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)

        if metadata.all_greedy and not metadata.has_logits_processors:
            # Nothing rewrites the logits: argmax reads them as they are (a copy of [N, V] float32
            # cost about as much as the argmax itself at 16-64 rows).
            sampled = argmax_rows(logits)
        else:
            sampled = self._process_and_sample(logits, metadata)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    @staticmethod
    def _process_and_sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        x = logits.to(torch.float32, copy=True)  # processed in place from here on
        x = apply_logits_processors(x, metadata)

        if metadata.all_greedy:
            sampled = argmax_rows(x)
        else:
            greedy_ids = argmax_rows(x) if metadata.greedy_mask is not None else None
            sampled = _sample_random(x, metadata)
            if greedy_ids is not None:
                sampled = torch.where(metadata.greedy_mask, greedy_ids, sampled)
        return sampled


_ARGMAX_CHUNK = 128


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of [N, V] logits, the same indices (first occurrence of the maximum; a
    NaN counts as the maximum, as in argmax).

    On the CPU, argmax over a row is scalar code (~2.6 ns an element: 8 ms for 64 x 49152 logits,
    1 thread) while amax is vectorized; so take the maximum of each 128-wide chunk, the first chunk
    holding the row's maximum (argmax over V/128 values), then the first maximum inside that chunk:
    6-9x faster at 16-64 rows. Other devices, and vocabularies not a multiple of the chunk, use argmax.
    """
    num_rows, vocab = x.shape
    if x.device.type != "cpu" or vocab % _ARGMAX_CHUNK or not x.is_contiguous() or not x.is_floating_point():
        return x.argmax(dim=-1)
    chunks = x.view(num_rows, vocab // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [N]: NaN propagates through amax, argmax picks it
    within = chunks[torch.arange(num_rows), chunk].argmax(dim=-1)
    return chunk * _ARGMAX_CHUNK + within


def apply_logits_processors(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply logit_bias, min_tokens suppression and penalties to float32 logits `x` in place."""
    vocab = x[:, : metadata.vocab_size]  # the model may pad its vocabulary; ids beyond are never biased
    if metadata.logit_bias is not None:
        rows, tokens, biases = metadata.logit_bias
        vocab.index_put_((rows, tokens), biases, accumulate=True)
    if metadata.suppressed is not None:
        rows, tokens = metadata.suppressed
        vocab[rows, tokens] = float("-inf")
    if metadata.output_counts is not None:
        counts = metadata.output_counts
        if metadata.prompt_mask is not None:
            seen = metadata.prompt_mask | (counts > 0)
            penalty = torch.where(seen, metadata.repetition_penalty[:, None], 1.0)
            vocab.copy_(torch.where(vocab > 0, vocab / penalty, vocab * penalty))
        vocab -= metadata.frequency_penalty[:, None] * counts
        vocab -= metadata.presence_penalty[:, None] * (counts > 0).to(torch.float32)
    if metadata.token_bitmask is not None:
        apply_token_bitmask(x, *metadata.token_bitmask)
    return x


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set x[r, t] to -inf where bit t of bitmask[r] is 0, for r in rows, in place: one op over the
    whole [rows, V] block (xgrammar's kernel: C++ on the CPU, Triton on CUDA). Token ids beyond the
    bitmask (a vocabulary padded past it) are forbidden too: no grammar can accept them."""
    import xgrammar  # lazily: only structured outputs need it

    covered = min(x.shape[1], bitmask.shape[1] * 32)
    xgrammar.apply_token_bitmask_inplace(x, bitmask, vocab_size=covered, indices=rows)
    if covered < x.shape[1]:
        x[rows, covered:] = float("-inf")


def _sample_random(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Sample every row of processed logits `x` as if it were random (greedy rows are fixed later)."""
    return _inverse_cdf_draw(sampling_probs(x, metadata), _uniforms(metadata, x.device))


def sampling_probs(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from: processed logits `x` (changed in place) through
    temperature, top-k/top-p and min-p. Speculative verification scores proposals against it too."""
    x.div_(metadata.temperature[:, None])
    if metadata.top_p is not None:
        x = _apply_top_p_on_candidates(x, metadata.top_k, metadata.top_p)
    elif metadata.top_k is not None:
        x = _apply_top_k(x, metadata.top_k, metadata.max_top_k)
    probs = torch.softmax(x, dim=-1)
    if metadata.min_p is not None:
        max_probs = probs.max(dim=-1, keepdim=True).values
        probs.masked_fill_(probs < metadata.min_p[:, None] * max_probs, 0.0)
    return probs


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep the top_k largest logits per row (ties at the threshold are kept too); no full sort."""
    top_values = x.topk(max_k, dim=-1).values  # [N, max_k], descending
    threshold = top_values.gather(1, (top_k - 1).clamp(max=max_k - 1)[:, None])
    return x.masked_fill_(x < threshold, float("-inf"))


_TOP_P_CANDIDATES = 1024


def _apply_top_p_on_candidates(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """`_apply_top_k_top_p` without sorting the whole vocabulary when each nucleus lies in the top 1024.

    A full descending sort of [64, 49152] logits cost ~0.5-1 s a step on one CPU core. The 1024
    largest logits (topk, already in order) nearly always carry top_p of a row's mass; then every
    later token is cut by top_p anyway, and the kept set is decided on these candidates alone,
    against the row's own normaliser (the whole row, or its top-k). Rows with top_p off keep what
    top_k leaves them. The full sort serves the rest: a candidate set short of top_p (a flat
    distribution), or a top_k between the candidate count and the vocabulary.
    """
    num_rows, vocab = x.shape
    num_candidates = min(_TOP_P_CANDIDATES, vocab)
    whole_row = top_k >= vocab if top_k is not None else torch.ones(num_rows, dtype=torch.bool, device=x.device)
    if num_candidates == vocab or (top_k is not None and bool(((top_k > num_candidates) & ~whole_row).any())):
        return _apply_top_k_top_p(x, top_k, top_p)
    values, indices = x.topk(num_candidates, dim=-1)  # [N, C], descending
    log_total = torch.logsumexp(x, dim=-1, keepdim=True)
    if top_k is not None:
        positions = torch.arange(num_candidates, device=x.device)
        values.masked_fill_(positions[None, :] >= top_k[:, None], float("-inf"))
        # top_p is taken over the top-k renormalised distribution
        log_total = torch.where(whole_row[:, None], log_total, torch.logsumexp(values, dim=-1, keepdim=True))
    probs = torch.exp(values - log_total)
    cumulative = probs.cumsum(dim=-1)
    top_p_off = top_p > 1.0
    if not bool(((cumulative[:, -1] >= top_p) | top_p_off).all()):
        return _apply_top_k_top_p(x, top_k, top_p)
    remove = (cumulative - probs) >= top_p[:, None]
    remove[:, 0] = False
    values.masked_fill_(remove, float("-inf"))
    out = torch.full_like(x, float("-inf")).scatter_(1, indices, values)
    return torch.where((top_p_off & whole_row)[:, None], x, out)


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """One descending sort serves both filters; top_p is taken over the top_k-renormalized probs."""
    sorted_x, sorted_idx = x.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(x.shape[1], device=x.device)
        sorted_x.masked_fill_(positions[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    # Drop a token once the tokens before it already reach top_p; the first is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove = mass_before >= top_p[:, None]
    remove[:, 0] = False
    sorted_x.masked_fill_(remove, float("-inf"))
    return torch.empty_like(x).scatter_(1, sorted_idx, sorted_x)


def _uniforms(metadata: SamplingMetadata, device) -> torch.Tensor:
    """[N, 1] float64 in [0, 1): a seeded row's from its generator, the unseeded rows' from one shared draw."""
    u = torch.full((metadata.num_rows, 1), 0.5, dtype=torch.float64, device=device)  # greedy rows: unused
    if metadata.unseeded_random_rows is not None:
        rows = metadata.unseeded_random_rows
        u[rows, 0] = torch.rand(rows.shape[0], dtype=torch.float64, device=device)
    for row, generator in metadata.generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
    return u


_CDF_BLOCK = 128


def _inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token i of each row with probability probs[i] / sum(probs): the first i whose cumulative mass
    exceeds u * total. A token of zero probability is never drawn (its cumulative mass equals the
    previous token's, which would have been found first).

    One uniform per row instead of an Exp(1) draw per vocabulary entry (the exponential race): at
    64 x 49152 the noise alone cost ~100 ms a step on one CPU core, this ~2 ms. The cumulative sums
    run in float64 so tiny probabilities keep their mass (a float32 running sum over 49152 entries
    rounds away anything below ~1e-7): float32 sums of 128-wide blocks pick the block, then a
    float64 cumulative sum inside that block picks the token.
    """
    num_rows, vocab = probs.shape
    if vocab % _CDF_BLOCK:
        blocks = probs.to(torch.float64).view(num_rows, 1, vocab)
    else:
        blocks = probs.view(num_rows, vocab // _CDF_BLOCK, _CDF_BLOCK)
    width = blocks.shape[2]
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)  # [N, B]
    zero = torch.zeros((), dtype=torch.float64, device=probs.device)
    total = block_cdf[:, -1:]
    target = torch.minimum(u * total, total.nextafter(zero))  # strictly below the total: some block exceeds it
    # Clamped only for rows with no mass at all (NaN or all zero: a broken row must not index out of range).
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [N, 1]
    mass_before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), zero)
    inner_cdf = blocks[torch.arange(num_rows, device=probs.device), block[:, 0]].to(torch.float64).cumsum_(dim=-1)
    # The float32 block sum and the float64 sum inside the block may differ in the last bits.
    rest = torch.minimum(target - mass_before, inner_cdf[:, -1:].nextafter(zero))
    within = torch.searchsorted(inner_cdf, rest, right=True).clamp_(max=width - 1)
    return (block * width + within)[:, 0]


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logprobs [N, V] and chosen token_ids [N]: ids [N, 1+k], their logprobs [N, 1+k], ranks [N].

    Column 0 is the chosen token; columns 1.. are the k most likely tokens, most likely first.
    Rank is 1 + the number of tokens with a strictly greater logprob.
    """
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        ids, values = token_ids[:, None], chosen
    return ids, values, ranks


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of each prompt token from the logits that predicted it.

    logits [P, V] are the raw logits at positions 0..P-1; target_token_ids [P] the tokens at
    positions 1..P. Returns (token_ids [P, 1+k], logprobs [P, 1+k] float32, ranks [P] int64), laid
    out like SamplerOutput: column 0 the prompt token, then the top k.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return gather_logprobs(logprobs, target_token_ids, num_logprobs)


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
