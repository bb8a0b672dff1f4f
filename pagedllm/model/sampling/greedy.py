"""One greedy path: each row's argmax of the model's logits, from its exact bfloat16 greedy head where that
applies (``layers/greedy_head.py``), else from the float32 logits, with the reason it fell back.

The model runner takes every all-greedy step's tokens here (rows that want nothing but the argmax: no
logprobs, nothing rewriting the logits), whether or not it built sampling metadata for the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.layers.greedy_head import GreedyFallback
from pagedllm.model.sampling.sampler import argmax_rows


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
