"""Picking each row's token: argmax for greedy rows; for random rows one uniform number and an inverse-CDF
lookup. A seeded row draws its uniform from its own `torch.Generator`, so its tokens depend on nothing else
in the batch; unseeded rows share one draw from the default generator.
"""

from __future__ import annotations

import torch

from pagedllm.model.sampling.metadata import SamplingMetadata

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
