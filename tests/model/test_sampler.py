"""Sampler: processing order, filters, penalties, seeded determinism, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.model.sampling.logits_processors import apply_logits_processors
from pagedllm.model.sampling.logprobs import compute_prompt_logprobs
from pagedllm.model.sampling.metadata import SamplingMetadata, SamplingRow
from pagedllm.model.sampling.sampler import Sampler
from pagedllm.sampling_params import SamplingParams

V = 32


def _row(params: SamplingParams, prompt=(1, 2, 3), output=(), seed_generator=None, eos=(0,)) -> SamplingRow:
    return SamplingRow(
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=seed_generator,
        eos_token_ids=list(eos),
    )


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sample(logits: torch.Tensor, rows: list[SamplingRow]):
    metadata = SamplingMetadata.from_requests(rows, vocab_size=logits.shape[1], device=logits.device)
    return Sampler()(logits, metadata)


def _logits(num_rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=_generator(seed)) * 3


def test_greedy_is_argmax_and_draws_no_random_numbers():
    logits = _logits(5)
    state = torch.get_rng_state()
    g = _generator(7)
    g_state = g.get_state()
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(4)]
    rows.append(_row(SamplingParams(temperature=0.0, seed=7), seed_generator=g))
    out = _sample(logits, rows)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_token_ranks is None
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(g.get_state(), g_state)


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = _logits(6, seed=1)
    rows = [_row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=3)) for i in range(6)]
    out = _sample(logits, rows)
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(dim=-1))
    # random rows stay inside their top 3
    top3 = logits[1::2].topk(3, dim=-1).indices
    assert (top3 == out.sampled_token_ids[1::2, None]).any(dim=-1).all()


def test_top_k_one_equals_greedy():
    torch.manual_seed(0)
    logits = _logits(8, seed=2)
    out = _sample(logits, [_row(SamplingParams(temperature=1.3, top_k=1)) for _ in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_p_tiny_equals_greedy():
    torch.manual_seed(0)
    logits = _logits(8, seed=3)
    out = _sample(logits, [_row(SamplingParams(temperature=0.7, top_p=1e-6)) for _ in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_larger_than_vocab_and_top_p_one_are_no_ops():
    logits = _logits(3, seed=4)
    plain = [_row(SamplingParams(seed=5), seed_generator=_generator(5)) for _ in range(3)]
    filtered = [_row(SamplingParams(seed=5, top_k=10 * V, top_p=1.0), seed_generator=_generator(5)) for _ in range(3)]
    assert torch.equal(_sample(logits, plain).sampled_token_ids, _sample(logits, filtered).sampled_token_ids)


def test_tiny_temperature_is_greedy_and_finite():
    logits = _logits(4, seed=5) * 100
    out = _sample(logits, [_row(SamplingParams(temperature=1e-30)) for _ in range(4)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    out = _sample(logits, [_row(SamplingParams(temperature=1e-4)) for _ in range(4)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_and_top_p_together_keep_the_nucleus_of_the_top_k():
    # probs ~ [0.5, 0.3, 0.15, 0.05]: top_k=3 renormalizes to [.526, .316, .158]; top_p=0.8 keeps 2.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    torch.manual_seed(1)
    out = _sample(logits, [_row(SamplingParams(top_k=3, top_p=0.8)) for _ in range(200)])
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


def test_min_p_drops_unlikely_tokens():
    # probs [0.6, 0.3, 0.1]: min_p 0.4 keeps tokens with p >= 0.24 -> {0, 1}
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(300, 1)
    torch.manual_seed(2)
    out = _sample(logits, [_row(SamplingParams(min_p=0.4), eos=()) for _ in range(300)])
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = _row(params, prompt=[0, 1], output=[2, 2, 4], eos=())
    metadata = SamplingMetadata.from_requests([row], vocab_size=6, device="cpu")
    processed = apply_logits_processors(logits.clone(), metadata)
    expected = torch.tensor(
        [
            [
                2.0 / 2.0,  # prompt token, positive: divided
                -1.0 * 2.0,  # prompt token, negative: multiplied
                0.5 / 2.0 - 0.5 * 2 - 0.25,  # output twice: rep, then frequency x2 and presence once
                3.0,  # unseen
                -2.0 * 2.0 - 0.5 * 1 - 0.25,  # output once, negative
                1.0,  # unseen
            ]
        ]
    )
    assert torch.allclose(processed, expected)


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    row = _row(SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), prompt=[1, 1, 1], output=[2], eos=())
    processed = apply_logits_processors(logits.clone(), SamplingMetadata.from_requests([row], 4, "cpu"))
    assert processed.tolist() == [[0.0, 0.0, -2.0, 0.0]]


def test_no_penalty_tensors_without_penalties():
    metadata = SamplingMetadata.from_requests([_row(SamplingParams())], V, "cpu")
    assert metadata.output_counts is None and metadata.prompt_mask is None
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None


def test_logit_bias_forces_a_token():
    logits = _logits(4, seed=6)
    rows = [_row(SamplingParams(temperature=t, logit_bias={17: 100.0})) for t in (0.0, 1.0, 0.0, 1.0)]
    out = _sample(logits, rows)
    assert out.sampled_token_ids.tolist() == [17] * 4


def test_min_tokens_suppresses_eos_and_stop_ids_then_stops_suppressing():
    logits = torch.zeros(1, 8)
    logits[0, 0] = 50.0  # eos
    logits[0, 5] = 40.0  # stop token
    logits[0, 3] = 30.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert _sample(logits, [_row(params, output=[], eos=[0])]).sampled_token_ids.item() == 3
    assert _sample(logits, [_row(params, output=[3], eos=[0])]).sampled_token_ids.item() == 3
    assert _sample(logits, [_row(params, output=[3, 3], eos=[0])]).sampled_token_ids.item() == 0


def test_seeded_row_independent_of_batch_composition_and_position():
    logits_row = _logits(1, seed=8)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=1234)

    def run(batch_size: int, position: int, other_seed: int) -> int:
        others = _logits(batch_size, seed=other_seed)
        others[position] = logits_row
        rows = []
        for i in range(batch_size):
            if i == position:
                rows.append(_row(params, seed_generator=_generator(1234)))
            elif i % 3 == 0:
                rows.append(_row(SamplingParams(temperature=0.0)))
            elif i % 3 == 1:
                rows.append(_row(SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3)))
            else:
                rows.append(_row(SamplingParams(seed=i), seed_generator=_generator(i)))
        torch.manual_seed(other_seed)  # the default generator's state must not matter either
        return _sample(others, rows).sampled_token_ids[position].item()

    results = {run(1, 0, 10), run(4, 2, 11), run(7, 6, 12), run(7, 0, 13), run(3, 1, 14)}
    assert len(results) == 1


def test_seeded_generator_sequence_is_reproducible_across_steps():
    logits = _logits(1, seed=9)

    def run_steps() -> list[int]:
        g = _generator(42)
        return [_sample(logits, [_row(SamplingParams(seed=42), seed_generator=g)]).sampled_token_ids.item() for _ in range(20)]

    first = run_steps()
    assert first == run_steps()
    assert len(set(first)) > 1  # the generator advances between steps


def test_seeded_sampling_frequencies_follow_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    num_draws = 4000
    logits = torch.log(probs).repeat(num_draws, 1) * 2.0
    params = SamplingParams(temperature=2.0, seed=3)
    g = _generator(3)
    rows = [_row(params, seed_generator=g, eos=()) for _ in range(num_draws)]
    counts = torch.bincount(_sample(logits, rows).sampled_token_ids, minlength=5).float()
    assert torch.allclose(counts / num_draws, probs, atol=0.03)


def test_unseeded_sampling_frequencies_follow_softmax():
    probs = torch.tensor([0.6, 0.3, 0.1])
    torch.manual_seed(4)
    logits = torch.log(probs).repeat(4000, 1)
    counts = torch.bincount(_sample(logits, [_row(SamplingParams(), eos=())] * 4000).sampled_token_ids, minlength=3)
    assert torch.allclose(counts.float() / 4000, probs, atol=0.03)


def test_logprobs_and_ranks_come_from_the_raw_distribution():
    logits = _logits(3, seed=10)
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5, logit_bias={5: 100.0})),
        _row(SamplingParams(temperature=0.5, logprobs=1)),
        _row(SamplingParams(temperature=1.0)),
    ]
    out = _sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprob_token_ids.shape == (3, 4) and out.logprobs.shape == (3, 4)
    assert out.logprobs.dtype == torch.float32
    assert out.sampled_token_ids[0].item() == 5  # biased, but logprobs stay raw
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs, raw.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[:, 1:], raw.topk(3, dim=-1).indices)
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = (order == out.sampled_token_ids[:, None]).int().argmax(dim=-1) + 1
    assert torch.equal(out.sampled_token_ranks, expected_ranks)


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = _logits(2, seed=11)
    out = _sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=0))] * 2)
    assert out.logprob_token_ids.shape == (2, 1)
    assert out.sampled_token_ranks.tolist() == [1, 1]


def test_rank_counts_only_strictly_greater():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    out = _sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=2, logit_bias={2: 1.0}), eos=())])
    assert out.sampled_token_ids.item() == 2
    assert out.sampled_token_ranks.item() == 1


def test_compute_prompt_logprobs():
    logits = _logits(5, seed=12)
    targets = torch.tensor([3, 7, 1, 0, 31])
    ids, logprobs, ranks = compute_prompt_logprobs(logits, targets, num_logprobs=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert ids.shape == (5, 3) and logprobs.shape == (5, 3) and ranks.shape == (5,)
    assert torch.equal(ids[:, 0], targets)
    assert torch.allclose(logprobs, raw.gather(1, ids))
    assert torch.equal(ids[:, 1:], raw.topk(2, dim=-1).indices)
    assert torch.equal(ranks, (raw > raw.gather(1, targets[:, None])).sum(-1) + 1)
    assert math.isclose(logprobs.exp()[:, 1].max().item(), raw.exp().max(dim=-1).values.max().item(), rel_tol=1e-6)


def test_bfloat16_logits_are_processed_in_float32():
    logits = _logits(2, seed=13).to(torch.bfloat16)
    out = _sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=1))] * 2)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.0, 0.05, 0.7, 1.0, 2.5]),
    top_k=st.one_of(st.none(), st.integers(1, 40)),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-4]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    seeded=st.booleans(),
)
def test_sampled_token_survives_filtering(seed, temperature, top_k, top_p, min_p, seeded):
    """Property: the sampled token is in the top_k, inside the top_p nucleus and above min_p."""
    logits = torch.randn(3, V, generator=_generator(seed)) * 4
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed if seeded else None)
    rows = [_row(params, seed_generator=_generator(seed) if seeded else None, eos=()) for _ in range(3)]
    torch.manual_seed(seed)
    sampled = _sample(logits, rows).sampled_token_ids
    if temperature < 1e-5:
        assert torch.equal(sampled, logits.argmax(dim=-1))
        return
    scaled = logits / temperature
    for i in range(3):
        token = sampled[i].item()
        order = scaled[i].argsort(descending=True)
        position = (order == token).nonzero().item()
        if top_k is not None:
            assert position < top_k
        kept = scaled[i][order[: top_k or V]]
        probs = torch.softmax(kept, dim=-1)
        mass_before = probs[:position].sum().item()
        assert position == 0 or mass_before < top_p + 1e-5
        all_probs = torch.softmax(scaled[i], dim=-1)
        assert all_probs[token] >= min_p * all_probs.max() * (1 - 1e-4) or position == 0


def test_empty_logit_bias_and_out_of_vocab_ids_are_ignored():
    logits = _logits(1, seed=14)
    params = SamplingParams(temperature=0.0, logit_bias={V + 5: 100.0}, stop_token_ids=[V + 1], min_tokens=1)
    out = _sample(logits, [_row(params, eos=[V + 2])])
    assert out.sampled_token_ids.item() == logits.argmax().item()


@pytest.mark.parametrize("num_rows", [1, 5])
def test_padded_logits_wider_than_vocab(num_rows):
    logits = _logits(num_rows, seed=15, vocab=V + 8)
    rows = [_row(SamplingParams(temperature=0.0, logit_bias={3: 100.0}, repetition_penalty=1.2))] * num_rows
    metadata = SamplingMetadata.from_requests(rows, vocab_size=V, device="cpu")
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [3] * num_rows


def test_all_greedy_without_processors_reads_the_logits_untouched():
    logits = _logits(4, seed=11)
    before = logits.clone()
    metadata = SamplingMetadata.from_requests([_row(SamplingParams(temperature=0.0)) for _ in range(4)], V, "cpu")
    assert metadata.all_greedy and not metadata.has_logits_processors
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, before.argmax(dim=-1))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
    SamplingParams(temperature=0.0, presence_penalty=2.0),
    SamplingParams(temperature=0.0, min_tokens=3),
])
def test_all_greedy_with_processors_still_applies_them(params):
    # The argmax of the raw logits is a token the processor moves away from (or onto, for the bias).
    logits = torch.zeros(1, V)
    logits[0, 0] = 1.0  # the eos id of _row, and in the prompt and the output below
    logits[0, 1] = 0.9
    metadata = SamplingMetadata.from_requests([_row(params, prompt=(0,), output=(0,))], V, "cpu")
    assert metadata.all_greedy and metadata.has_logits_processors
    sampled = Sampler()(logits, metadata).sampled_token_ids.item()
    assert sampled == (5 if params.logit_bias else 1)


@pytest.mark.parametrize("num_rows,vocab", [(1, 128), (16, 49152), (64, 1024), (3, 1000), (5, 256),
                                              (1, 49152), (3, 32768)])
def test_argmax_rows_equals_argmax_with_ties_nan_and_inf(num_rows, vocab):
    from pagedllm.model.sampling.sampler import argmax_rows

    gen = _generator(vocab)
    x = torch.randn(num_rows, vocab, generator=gen)
    x[0, vocab - 1] = x[0, 1] = 50.0  # a tie across chunks: the first one wins
    if num_rows > 2:
        x[1, vocab // 2] = float("nan")  # NaN counts as the maximum
        x[1, vocab - 1] = float("nan")
        x[2] = float("-inf")  # all -inf: index 0
    if num_rows > 4:
        x[3, 3] = x[3, 4] = float("inf")  # a tie inside one chunk
        x[4] = 0.0  # all equal
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x.to(torch.bfloat16)), x.to(torch.bfloat16).argmax(dim=-1))


def _reference_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The definition: the first token whose float64 cumulative mass exceeds u * total."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]


@pytest.mark.parametrize("vocab", [256, 384, 300, 7])
def test_inverse_cdf_draw_is_the_first_token_past_u_times_the_mass(vocab):
    from pagedllm.model.sampling.sampler import inverse_cdf_draw

    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=g) * 3, dim=-1)
    probs[probs < probs.median(dim=-1, keepdim=True).values] = 0.0  # zeros, as top-k/top-p/min-p leave them
    u = torch.rand(64, 1, generator=g, dtype=torch.float64)
    u[:4, 0] = torch.tensor([0.0, 1e-12, 0.5, 1 - 2**-40], dtype=torch.float64)
    drawn = inverse_cdf_draw(probs, u)
    assert torch.equal(drawn, _reference_draw(probs, u))
    assert (probs.gather(1, drawn[:, None]) > 0).all()


def test_inverse_cdf_draw_never_picks_zero_probability_tokens_at_the_edges():
    from pagedllm.model.sampling.sampler import inverse_cdf_draw

    probs = torch.zeros(4, 256)
    probs[0, 5] = 1.0  # one token
    probs[1, [0, 255]] = 0.5  # the first and the last
    probs[2, 127:129] = 0.5  # straddling a block boundary
    probs[3, 200] = 3e-38  # a tiny total
    for u in (0.0, 1 - 2**-53, 0.5):
        drawn = inverse_cdf_draw(probs, torch.full((4, 1), u, dtype=torch.float64))
        assert (probs.gather(1, drawn[:, None]) > 0).all(), (u, drawn)


def test_inverse_cdf_draw_keeps_the_mass_of_tiny_probabilities():
    """Below the float32 resolution of a running sum over the vocabulary (~1e-7 here), a token still owns
    an interval of u as wide as its probability: found by bisection on the monotone map u -> token."""
    from pagedllm.model.sampling.sampler import inverse_cdf_draw

    probs = torch.full((1, 512), 1.0 / 511)
    probs[0, 300] = 1e-10
    total = probs.to(torch.float64).sum().item()

    def token(u: float) -> int:
        return inverse_cdf_draw(probs, torch.tensor([[u]], dtype=torch.float64)).item()

    def first_u_reaching(t: int) -> float:
        lo, hi = 0.0, 1.0 - 2**-53
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if token(mid) < t else (lo, mid)
        return hi

    start, end = first_u_reaching(300), first_u_reaching(301)
    assert token(start) == 300 == token((start + end) / 2)
    assert (end - start) * total == pytest.approx(1e-10, rel=1e-3)


def test_inverse_cdf_draw_survives_a_row_without_mass():
    from pagedllm.model.sampling.sampler import inverse_cdf_draw

    probs = torch.softmax(torch.randn(3, 256), dim=-1)
    probs[1] = float("nan")
    probs[2] = 0.0
    drawn = inverse_cdf_draw(probs, torch.full((3, 1), 0.3, dtype=torch.float64))
    assert ((drawn >= 0) & (drawn < 256)).all()
    assert drawn[0] == _reference_draw(probs[:1], torch.full((1, 1), 0.3, dtype=torch.float64))[0]


def test_random_sampling_frequencies_follow_top_k_over_a_large_vocabulary():
    """The whole random path at a real vocabulary size (several 128-wide blocks), seeded, against the
    renormalised top-k distribution."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 1024, generator=g) - 10.0
    chosen = torch.tensor([900, 3, 511, 128, 127, 640])  # spread over the 128-wide blocks, both sides of an edge
    logits[0, chosen] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.5])
    top = logits[0].topk(6)
    assert top.indices.tolist() == chosen.tolist()
    expected = torch.softmax(torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0]), dim=-1)
    params = SamplingParams(temperature=1.0, top_k=5, seed=11)
    gen = _generator(11)
    num_draws = 4000
    rows = [_row(params, seed_generator=gen, eos=()) for _ in range(num_draws)]
    drawn = _sample(logits.repeat(num_draws, 1), rows).sampled_token_ids
    assert set(drawn.tolist()) <= set(top.indices[:5].tolist())
    counts = torch.tensor([(drawn == t).sum().item() for t in top.indices[:5].tolist()], dtype=torch.float32)
    assert torch.allclose(counts / num_draws, expected, atol=0.03)


def test_top_p_on_candidates_equals_the_full_sort():
    """The top-1024 shortcut keeps exactly the tokens the full sort keeps: peaked rows (shortcut), flat rows
    (fallback), rows with top_p off, with and without top_k, and a top_k above the candidates (fallback)."""
    from pagedllm.model.sampling.sampler import _apply_top_k_top_p, _apply_top_p_on_candidates

    g = torch.Generator().manual_seed(3)
    vocab = 4096
    peaked = torch.randn(6, vocab, generator=g) * 6  # the nucleus fits in 1024 tokens
    flat = torch.randn(2, vocab, generator=g) * 0.1  # it does not
    top_p = torch.tensor([0.9, 0.5, 2.0, 0.99, 0.7, 2.0])
    cases = [(peaked, None, top_p), (peaked, torch.tensor([5, 4096, 50, 4096, 700, 4096]), top_p),
             (torch.cat([peaked[:2], flat]), None, torch.tensor([0.9, 0.8, 0.9, 2.0])),
             (peaked[:2], torch.tensor([2000, 4096]), torch.tensor([0.9, 0.9]))]
    for logits, top_k, p in cases:
        expected = _apply_top_k_top_p(logits.clone(), top_k, p)
        got = _apply_top_p_on_candidates(logits.clone(), top_k, p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
        assert torch.equal(got[torch.isfinite(got)], expected[torch.isfinite(expected)])
    # the shortcut really is taken for peaked rows: the full sort is never called
    import pagedllm.model.sampling.sampler as sampler_module

    original = sampler_module._apply_top_k_top_p
    sampler_module._apply_top_k_top_p = None
    try:
        assert torch.isfinite(_apply_top_p_on_candidates(peaked.clone(), None, top_p)).any()
    finally:
        sampler_module._apply_top_k_top_p = original


def test_plain_greedy_rows_are_exactly_those_the_sampler_takes_argmax_of_raw_logits():
    """The runner skips SamplingMetadata for a batch of plain_greedy rows: each must be a row whose
    metadata has nothing to apply or report (greedy, no processors, no logprobs)."""
    from pagedllm.model.sampling.metadata import plain_greedy
    from pagedllm.sampling_params import StructuredOutputsParams

    plain = SamplingParams(temperature=0.0, max_tokens=4)
    assert plain_greedy(plain)
    md = SamplingMetadata.from_requests([SamplingRow(plain, [1, 2], [3])], 8, "cpu")
    assert md.all_greedy and not md.has_logits_processors and md.max_num_logprobs is None
    others = [dict(temperature=0.7), dict(logprobs=0), dict(logit_bias={3: 1.0}), dict(min_tokens=2),
              dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
              dict(structured_outputs=StructuredOutputsParams(regex="a+"))]
    for changed in others:
        assert not plain_greedy(SamplingParams(**{"temperature": 0.0, **changed})), changed
