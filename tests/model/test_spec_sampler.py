"""The rejection sampler of speculative decoding (model/sampling/rejection_sampler.py) keeps the target distribution.

Chi-square goodness of fit over many seeded draws; each test fails by chance with probability
ALPHA = 1e-3 for a correct sampler (the seeds are fixed, so a given run is deterministic: a correct
sampler passes these seeds, which were not chosen after looking at results)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.sampling.metadata import SamplingMetadata, SamplingRow
from pagedllm.model.sampling.rejection_sampler import SpecRequestRows, verify
from pagedllm.sampling_params import SamplingParams

ALPHA = 1e-3
VOCAB = 8


def chi_square_p_value(observed: list[float], expected: list[float]) -> float:
    """P(X >= statistic) for X ~ chi2(cells - 1); cells with expected < 5 are pooled into one."""
    big = [(o, e) for o, e in zip(observed, expected) if e >= 5]
    small_o = sum(o for o, e in zip(observed, expected) if e < 5)
    small_e = sum(e for e in expected if e < 5)
    if small_e > 0:
        big.append((small_o, small_e))
    statistic = sum((o - e) ** 2 / e for o, e in big)
    df = len(big) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _metadata(params: SamplingParams, num_rows: int, generator=None) -> SamplingMetadata:
    rows = [SamplingRow(params=params, prompt_token_ids=[0], output_token_ids=[], generator=generator)
            for _ in range(num_rows)]
    return SamplingMetadata.from_requests(rows, VOCAB, "cpu")


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.9)])
def test_first_and_second_tokens_follow_the_target_distributions(params):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5  # positions 0, 1 (after the first proposal) and the bonus
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argsort()[-3])]  # plausible, not the mode
    num_draws = 6000
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    num_second = 0
    num_accepted = 0
    for seed in range(num_draws):
        generator = torch.Generator().manual_seed(seed)
        (kept,) = verify(logits, _metadata(params, 3, generator), [SpecRequestRows(0, drafts, False, generator)])
        first[kept[0]] += 1
        num_accepted += len(kept) - 1
        if kept[0] == drafts[0]:  # given the first proposal was kept, the second token follows p_1
            second[kept[1]] += 1
            num_second += 1
    from pagedllm.model.sampling.rejection_sampler import target_probs

    _, probs = target_probs(logits, _metadata(params, 3))
    assert 0 < num_accepted < 2 * num_draws  # both accept and reject paths ran
    assert chi_square_p_value(first.tolist(), (probs[0] * num_draws).tolist()) > ALPHA
    assert chi_square_p_value(second.tolist(), (probs[1] * num_second).tolist()) > ALPHA


def test_a_wrong_sampler_is_caught():
    """The statistic has power: drawing the first token from the bonus row's distribution fails."""
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 1.5
    probs = torch.softmax(logits, dim=-1)
    draws = torch.multinomial(probs[1], 6000, replacement=True, generator=torch.Generator().manual_seed(1))
    observed = torch.bincount(draws, minlength=VOCAB).float()
    assert chi_square_p_value(observed.tolist(), (probs[0] * 6000).tolist()) < ALPHA


def test_greedy_keeps_proposals_while_they_are_the_argmax():
    logits = torch.full((4, VOCAB), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 1] = logits[3, 6] = 2.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, _metadata(greedy, 4), [SpecRequestRows(0, [3, 5, 1], True, None)]) == [[3, 5, 1, 6]]
    assert verify(logits, _metadata(greedy, 4), [SpecRequestRows(0, [3, 4, 1], True, None)]) == [[3, 5]]
    assert verify(logits, _metadata(greedy, 4), [SpecRequestRows(0, [0, 5, 1], True, None)]) == [[3]]


def test_seeded_verification_is_reproducible():
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, seed=5)
    results = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(5)
        results.append([verify(logits, _metadata(params, 4, generator), [SpecRequestRows(0, [1, 2, 3], False, generator)])
                        for _ in range(20)])
    assert results[0] == results[1]
