"""Random rows (vLLM's topk_topp_sampler): processed logits / temperature ─► top-k ─► top-p ─► min-p gives the
distribution a row samples from (`sampling_probs`); then one uniform number and an inverse-CDF lookup draw the
token (`random_sample`).

Top-k and top-p avoid sorting the whole vocabulary where they can: top-k takes `topk` of the largest k,
top-p looks for each nucleus among the 1024 largest logits first (see `_apply_top_p_on_candidates`).
A seeded row draws its uniform from its own `torch.Generator`, so its tokens depend on nothing else in the
batch; unseeded rows share one draw from the default generator.
"""

from __future__ import annotations

import torch

from pagedllm.model.sampling.metadata import SamplingMetadata


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
