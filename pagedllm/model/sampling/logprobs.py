"""The logprobs reported to the user: of the raw logits (before any processor), with each chosen token's rank."""

from __future__ import annotations

import torch


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
