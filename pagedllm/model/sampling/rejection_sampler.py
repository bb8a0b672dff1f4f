"""Verify speculative proposals losslessly: the tokens kept are distributed exactly as plain sampling's.

A request with k proposals d_1..d_k has k + 1 scored positions; position j's logits are what
plain decoding would have seen after d_1..d_j, processed the same way (logit_bias, min_tokens,
penalties, temperature, top-k/p, min-p: `sampling/sampler.py`), giving the target distribution p_j.

- Greedy rows: keep d_j while it is argmax p_j; the first disagreement (or position k) gives the
  model's own token. Exactly the tokens plain greedy decoding produces.
- Random rows (rejection sampling, proposal q = one-hot on d_j): keep d_j with probability
  min(1, p_j(d_j) / q(d_j)) = p_j(d_j); on the first rejection draw from the residual
  max(0, p_j - q) / Z, i.e. p_j with d_j removed, renormalised; if all k are kept, draw the bonus
  from p_k. Each emitted token is then distributed as p_j given the ones before it.

Seeded rows draw their uniforms and noise from the request's generator in a fixed order (k uniforms,
then k + 1 rows of exponential noise), so a seeded request is reproducible with speculation on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.sampling.logits_processors import apply_logits_processors
from pagedllm.model.sampling.metadata import SamplingMetadata
from pagedllm.model.sampling.sampler import argmax_rows, sampling_probs


@dataclass(slots=True)
class SpecRequestRows:
    """One speculating request's rows in the logits: `first` .. `first + len(draft_ids)` (the last is the bonus)."""

    first: int
    draft_ids: list[int]
    greedy: bool
    generator: torch.Generator | None


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax of the processed logits [R], the sampling distributions [R, V] or None when every row is greedy)."""
    x = logits.to(torch.float32, copy=True)
    x = apply_logits_processors(x, metadata)
    greedy_ids = argmax_rows(x)
    if metadata.all_greedy:
        return greedy_ids, None
    probs = sampling_probs(x, metadata)  # the plain sampler's distribution
    return greedy_ids, probs


def verify(logits: torch.Tensor, metadata: SamplingMetadata, requests: list[SpecRequestRows]) -> list[list[int]]:
    """For each request, the kept proposals plus one token of the model's own (1 .. k + 1 tokens).

    logits: [R, V], every request's k + 1 rows in `requests` order; metadata describes those rows.
    One host sync.
    """
    greedy_ids, probs = target_probs(logits, metadata)
    device = logits.device
    random = [r for r in requests if not r.greedy]
    accept = candidates = None
    if random:
        assert probs is not None
        draft_rows, draft_ids, all_rows, residual_rows = [], [], [], []
        for r in random:
            for j, draft in enumerate(r.draft_ids):
                draft_rows.append(r.first + j)
                draft_ids.append(draft)
                residual_rows.append(len(all_rows) + j)
            all_rows.extend(range(r.first, r.first + len(r.draft_ids) + 1))
        draft_ids_t = torch.tensor(draft_ids, dtype=torch.int64, device=device)
        uniforms, noise = _draw(random, probs.shape[1], device)
        accept = uniforms < probs[torch.tensor(draft_rows, device=device), draft_ids_t]  # [D]
        # Residual of every proposal's position (its mass removed: sampled without renormalising, the
        # race below is scale-free); the bonus row keeps p_k.
        residual = probs[torch.tensor(all_rows, device=device)]  # [A, V], a copy
        residual[torch.tensor(residual_rows, device=device), draft_ids_t] = 0.0
        candidates = residual.div_(noise).argmax(dim=-1)  # exponential race: one draw from each row
    packed = [greedy_ids] + ([accept.to(torch.int64), candidates] if random else [])
    flat = torch.cat(packed).tolist()  # the one host sync
    num_rows = greedy_ids.shape[0]
    greedy_host = flat[:num_rows]
    accept_host = flat[num_rows:num_rows + (accept.shape[0] if random else 0)]
    candidates_host = flat[num_rows + len(accept_host):]

    results: list[list[int]] = []
    a = c = 0  # cursors into the random requests' accept / candidate lists
    for r in requests:
        k = len(r.draft_ids)
        kept: list[int] = []
        if r.greedy:
            for j, draft in enumerate(r.draft_ids):
                if greedy_host[r.first + j] != draft:
                    break
                kept.append(draft)
            kept.append(greedy_host[r.first + len(kept)])
        else:
            for j, draft in enumerate(r.draft_ids):
                if not accept_host[a + j]:
                    break
                kept.append(draft)
            kept.append(candidates_host[c + len(kept)])
            a += k
            c += k + 1
        results.append(kept)
    return results


def _draw(random: list[SpecRequestRows], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [D] for the accept tests and Exp(1) noise [A, V] for the draws, per request: from its
    generator when seeded, else from the shared stream."""
    uniforms, noise = [], []
    for r in random:
        k = len(r.draft_ids)
        g = r.generator
        uniforms.append(torch.rand(k, generator=g, device=device))
        noise.append(torch.empty(k + 1, vocab, device=device).exponential_(generator=g))
    q = torch.cat(noise)
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # a zero-probability token must never win with 0 / 0
    return torch.cat(uniforms), q
