"""The per-step compiled ops of csrc/step_ops.cpp against their torch forms: the quantized row lookup
(``dequantize_rows``) bit for bit per kernel type, and ``argmax_rows`` index for index against
``torch.argmax`` on ties, NaNs, infinities, signed zeros and ragged widths."""

import numpy as np
import pytest
import torch

from pagedllm.model.attention import cpu_op
from pagedllm.model.layers import quantized
from pagedllm.model.sampling import sampler
from tests.model.test_quant_kernels import QTYPES, K_QUANTS, quantized_weight

needs_ops = pytest.mark.skipif(not cpu_op.load() or not hasattr(torch.ops.pagedllm, "argmax_rows_cpu"),
                               reason="compiled library unavailable")


@needs_ops
@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_rows_equal_torch_form_and_gguf(qtype):
    k = 512 if qtype in K_QUANTS else 96
    qt, w_deq = quantized_weight(qtype, 37, k, seed=3)
    kernel_type = quantized.KERNEL_TYPE[qtype]
    packed = quantized.repack(qtype, qt.raw)
    ids = torch.tensor([36, 0, 17, 17, 5, 31, 16, 15])
    rows = torch.ops.pagedllm.quant_rows_cpu(packed, kernel_type, ids)
    assert torch.equal(rows, quantized.dequantize_rows_torch(kernel_type, packed, ids))
    assert torch.equal(rows, torch.from_numpy(w_deq[ids.numpy()]))
    assert torch.equal(quantized.dequantize_rows(kernel_type, packed, torch.arange(37)), torch.from_numpy(w_deq))
    two_d = torch.tensor([[3, 4], [36, 1]])
    assert torch.equal(torch.ops.pagedllm.quant_rows_cpu(packed, kernel_type, two_d),
                       torch.from_numpy(w_deq[two_d.reshape(-1).numpy()]))
    assert torch.ops.pagedllm.quant_rows_cpu(packed, kernel_type, torch.empty(0, dtype=torch.int64)).shape == (0, k)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pagedllm.quant_rows_cpu(packed, kernel_type, torch.tensor([48]))  # past the padded panels
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pagedllm.quant_rows_cpu(packed, kernel_type, torch.tensor([-1]))


def argmax_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for rows, vocab in ((1, 49152), (3, 1000), (2, 37), (1, 1), (5, 8), (17, 200), (2, 33)):
        cases.append(torch.randn(rows, vocab, generator=gen))
    tie = torch.zeros(2, 300)
    tie[0, [7, 100, 299]] = 5.0  # first of equal maxima
    tie[1, 250] = float("inf")
    tie[1, 40] = float("inf")
    cases.append(tie)
    nan = torch.randn(3, 300, generator=gen)
    nan[0, 200] = float("nan")  # a NaN counts as the maximum, the first one wins
    nan[0, 290] = float("nan")
    nan[1, 298] = float("nan")  # in the scalar tail past the vector loop
    nan[2, 5] = float("inf")
    cases.append(nan)
    zeros = torch.full((2, 64), float("-inf"))
    zeros[0, 10], zeros[0, 20] = -0.0, 0.0  # signed zeros compare equal: the first
    cases.append(zeros)  # row 1: every value -inf -> 0
    big = torch.randn(70, 512, generator=gen)  # past the op's per-thread grain
    big[13, 511] = 100.0
    cases.append(big)
    return cases


@needs_ops
@pytest.mark.parametrize("case", range(len(argmax_cases())))
def test_argmax_rows_op_equals_torch_argmax(case):
    x = argmax_cases()[case]
    expected = x.argmax(dim=-1)
    assert torch.equal(torch.ops.pagedllm.argmax_rows_cpu(x), expected)
    assert torch.equal(sampler.argmax_rows(x), expected)


def test_argmax_rows_without_op_equals_torch_argmax(monkeypatch):
    monkeypatch.setitem(sampler._ARGMAX_OP, "op", None)  # the torch path (no library)
    for x in argmax_cases():
        assert torch.equal(sampler.argmax_rows(x), x.argmax(dim=-1))
    x = torch.randn(2, 256, dtype=torch.float64)  # not float32: torch either way
    assert torch.equal(sampler.argmax_rows(x), x.argmax(dim=-1))


@needs_ops
def test_argmax_rows_non_contiguous_takes_torch():
    x = torch.randn(4, 256).t()
    assert torch.equal(sampler.argmax_rows(x), x.argmax(dim=-1))
    assert np.array_equal(sampler.argmax_rows(x).numpy(), x.numpy().argmax(axis=-1))
