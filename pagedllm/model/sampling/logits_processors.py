"""Logits processors: the rewrites of a row's logits before temperature and truncation, in vLLM's order.

    logit_bias ─► min_tokens (eos + stop ids to -inf while the output is short)
        ─► penalties: repetition (prompt + output), frequency and presence (output only)
        ─► structured outputs: tokens the row's grammar forbids to -inf (one bitmask op)
"""

from __future__ import annotations

import torch

from pagedllm.model.sampling.metadata import SamplingMetadata


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
