"""Turn one step's logits into sampled tokens (and logprobs), one row per sequence.

The sampler knows nothing of scheduling: the model runner describes each row it samples with a
`SamplingRow`, packs them once per step into a `SamplingMetadata` of tensors (metadata.py), and calls
`Sampler`, which composes the steps below: the processors (logits_processors.py), greedy rows by
argmax, random rows by the draw at the end of this file, and the logprobs (logprobs.py). An all-greedy
step of plain rows skips all that: `greedy_tokens` takes the model's greedy head where it has one.

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

Top-k and top-p avoid sorting the whole vocabulary where they can: top-k takes `topk` of the largest k,
top-p looks for each nucleus among the 1024 largest logits first (see `_apply_top_p_on_candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.model.layers.greedy_head import GreedyFallback
from pagedllm.model.sampling.logits_processors import apply_logits_processors
from pagedllm.model.sampling.logprobs import gather_logprobs
from pagedllm.model.sampling.metadata import SamplingMetadata


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
        if metadata.has_logits_processors:
            x = apply_logits_processors(x, metadata)

        if metadata.all_greedy:
            sampled = argmax_rows(x)
        else:
            greedy_ids = argmax_rows(x) if metadata.greedy_mask is not None else None
            sampled = random_sample(x, metadata)
            if greedy_ids is not None:
                sampled = torch.where(metadata.greedy_mask, greedy_ids, sampled)
        return sampled


_ARGMAX_CHUNK = 128
_ARGMAX_PIECE = 16384
"""Floats per amax call below _ARGMAX_SERIAL_MAX: under ATen's parallel grain, so each runs on the caller."""
_ARGMAX_SERIAL_MAX = 1 << 17
"""Logits (rows x vocab) up to which argmax_rows stays on the calling thread (1-2 rows of 49152)."""


def _argmax_op():
    """The compiled ``argmax_rows_cpu``'s C++ callable, or None where the library is not loaded."""
    if "op" not in _ARGMAX_OP:
        from pagedllm.model.attention import cpu_op

        overload = getattr(torch.ops.pagedllm, "argmax_rows_cpu", None) if cpu_op.load() else None
        _ARGMAX_OP["op"] = None if overload is None else getattr(overload.default, "_op", overload.default)
    return _ARGMAX_OP["op"]


_ARGMAX_OP: dict[str, object] = {}


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of [N, V] logits, the same indices (first occurrence of the maximum; a
    NaN counts as the maximum, as in argmax).

    On a CPU float32 batch with the compiled library: one call of ``argmax_rows_cpu`` (vectorized
    max, then the first index equal to it; ~10 ATen calls less a step at batch 1). Otherwise:

    On the CPU, argmax over a row is scalar code (~2.6 ns an element: 8 ms for 64 x 49152 logits,
    1 thread) while amax is vectorized; so take the maximum of each 128-wide chunk, the first chunk
    holding the row's maximum (argmax over V/128 values), then the first maximum inside that chunk:
    6-9x faster at 16-64 rows. Other devices, and vocabularies not a multiple of the chunk, use argmax.
    """
    num_rows, vocab = x.shape
    if x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and vocab and _argmax_op() is not None:
        return _ARGMAX_OP["op"](x)  # one compiled call (csrc/step_ops.cpp): the same indices, no ATen calls
    if x.device.type != "cpu" or vocab % _ARGMAX_CHUNK or not x.is_contiguous() or not x.is_floating_point():
        return x.argmax(dim=-1)
    num_chunks = vocab // _ARGMAX_CHUNK
    flat = x.view(num_rows * num_chunks, _ARGMAX_CHUNK)
    if num_rows * vocab <= _ARGMAX_SERIAL_MAX:
        # In pieces of _ARGMAX_PIECE floats, each under ATen's grain (32768), so no OpenMP region
        # opens: at batch 1 the engine's passive OpenMP workers cost more to wake than the whole
        # amax (one row of 49152: 13.6 ms -> 0.26 ms per call, 2 threads on a contended 2-core
        # machine, /tmp microbenchmark; ~0.1 ms -> ~0.03 ms idle).
        step = _ARGMAX_PIECE // _ARGMAX_CHUNK
        maxes = torch.cat([flat[i : i + step].amax(dim=-1) for i in range(0, flat.shape[0], step)])
    else:
        maxes = flat.amax(dim=-1)
    chunk = maxes.view(num_rows, num_chunks).argmax(dim=-1)  # [N]: NaN propagates through amax, argmax picks it
    # index_select, not advanced indexing: the same rows without aten::index's overhead
    within = flat.index_select(0, chunk + torch.arange(0, num_rows * num_chunks, num_chunks)).argmax(dim=-1)
    return chunk * _ARGMAX_CHUNK + within


# One greedy path: each row's argmax of the model's logits, from its exact bfloat16 greedy head where that
# applies (layers/greedy_head.py), else from the float32 logits, with the reason it fell back. The model
# runner takes every all-greedy step's tokens here (rows that want nothing but the argmax: no logprobs,
# nothing rewriting the logits), whether or not it built sampling metadata for the step.


@dataclass(frozen=True, slots=True)
class GreedyTokens:
    """A step's greedy tokens and where they came from."""

    token_ids: torch.Tensor
    """[N] int64: each row's argmax of ``model.compute_logits``."""
    fallback: GreedyFallback | None
    """Why the float32 logits gave them; None where the greedy head did."""


def greedy_tokens(model, hidden_states: torch.Tensor) -> GreedyTokens:
    """``argmax(model.compute_logits(hidden_states))`` per row ([N, hidden] -> [N]), through the model's
    greedy head where it has one for these rows."""
    from_head = model.greedy_token_ids(hidden_states)
    if isinstance(from_head, GreedyFallback):
        return GreedyTokens(argmax_rows(model.compute_logits(hidden_states)), from_head)
    return GreedyTokens(from_head, None)


# Random rows (vLLM's topk_topp_sampler): processed logits / temperature ─► top-k ─► top-p ─► min-p give the
# distribution a row samples from (`sampling_probs`); then one uniform number and an inverse-CDF lookup draw
# the token (`random_sample`).


def random_sample(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Sample every row of processed logits `x` as if it were random (greedy rows are fixed later)."""
    return inverse_cdf_draw(sampling_probs(x, metadata), row_uniforms(metadata, x.device))


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


def row_uniforms(metadata: SamplingMetadata, device) -> torch.Tensor:
    """[N, 1] float64 in [0, 1): a seeded row's from its generator, the unseeded rows' from one shared draw."""
    u = torch.full((metadata.num_rows, 1), 0.5, dtype=torch.float64, device=device)  # greedy rows: unused
    if metadata.unseeded_random_rows is not None:
        rows = metadata.unseeded_random_rows
        u[rows, 0] = torch.rand(rows.shape[0], dtype=torch.float64, device=device)
    for row, generator in metadata.generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
    return u


_CDF_BLOCK = 128


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
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
