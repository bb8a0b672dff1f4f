"""The bfloat16-candidates greedy head returns float32's argmax, including on near-ties that
bfloat16 alone would get wrong."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.layers import greedy_head
from pagedllm.model.layers.greedy_head import GreedyFallback, GreedyHead


def _float32_argmax(hidden, weight):
    return F.linear(hidden.double(), weight.double()).argmax(-1)


@pytest.mark.parametrize("rows", [4, 17, 64])
def test_matches_float32_argmax_on_random_heads(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(5000, 96, generator=gen) * 0.1
    hidden = torch.randn(rows, 96, generator=gen) * 4
    head = GreedyHead.build(weight, force=True)
    assert torch.equal(head.argmax(hidden, weight), _float32_argmax(hidden, weight))


def test_near_ties_that_bfloat16_flips_are_resolved_in_float32():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 64, generator=gen)
    weight = torch.randn(300, 64, generator=gen) * 0.05
    # Row 7 of the head is row 3 plus a nudge along each hidden row's direction too small for
    # bfloat16 to see (1e-4 of a logit), so token 7 wins in float32 for every row.
    weight[3] = hidden.mean(0) * 0.5
    weight[7] = weight[3] + 1e-6 * hidden.mean(0) / hidden.mean(0).norm()
    head = GreedyHead.build(weight, force=True)
    expected = _float32_argmax(hidden, weight)
    approx_only = F.linear(hidden.bfloat16(), head.weight_bf16).float().argmax(-1)
    got = head.argmax(hidden, weight)
    assert torch.equal(got, expected)
    assert (expected == 7).any() and not torch.equal(approx_only, expected)


def test_exact_ties_pick_the_first_index_like_argmax():
    weight = torch.randn(100, 32)
    weight[40] = weight[10] = weight.abs().max() * 3  # two identical, dominant rows
    hidden = torch.ones(5, 32)
    head = GreedyHead.build(weight, force=True)
    assert head.argmax(hidden, weight).tolist() == [10] * 5


def test_declines_few_rows_non_finite_and_flat_logits():
    weight = torch.randn(1000, 32)
    head = GreedyHead.build(weight, force=True)
    assert head.argmax(torch.randn(greedy_head.MIN_ROWS - 1, 32), weight) is GreedyFallback.FEW_ROWS
    assert head.argmax(torch.randn(6, 32, dtype=torch.float64), weight) is GreedyFallback.FEW_ROWS
    bad = torch.randn(6, 32)
    bad[2, 0] = float("nan")
    assert head.argmax(bad, weight) is GreedyFallback.UNBOUNDED_CANDIDATES
    flat = torch.zeros(1000, 32)  # every token ties: more candidates than worth recomputing
    assert GreedyHead.build(flat, force=True).argmax(torch.randn(6, 32), flat) is GreedyFallback.UNBOUNDED_CANDIDATES


def test_build_refuses_non_float32_and_honours_the_switch(monkeypatch):
    assert GreedyHead.build(torch.randn(10, 8, dtype=torch.float16), force=True) is None
    monkeypatch.setenv(greedy_head.DISABLE_ENV, "1")
    assert GreedyHead.build(torch.randn(10, 8)) is None


def test_scalar_loops_agree_with_the_vector_ones():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(3001, 72, generator=gen) * 0.1  # a vocabulary and width off the vector sizes
    hidden = torch.randn(9, 72, generator=gen) * 4
    head = GreedyHead.build(weight, force=True)
    approx = F.linear(hidden.bfloat16(), head.weight_bf16).contiguous()
    row_scale = head.gamma * hidden.norm(dim=1)
    u = 2.0**-8
    args = (approx, hidden, weight, head.row_norms, row_scale, u / (1 - u), greedy_head.MAX_CANDIDATES_PER_ROW)
    vector = torch.ops.pagedllm.greedy_select_cpu(*args)
    scalar = torch.ops.pagedllm.greedy_select_cpu(*args, True)
    assert torch.equal(vector, _float32_argmax(hidden, weight)) and torch.equal(scalar, vector)
