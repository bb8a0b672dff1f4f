"""The batch-invariant mode's GEMMs (``gemm_packed_invariant_cpu``, ``quant_gemm_invariant_cpu``):
each row's result is bitwise the same whatever rows come with it (1..300 of them), on both ISAs,
with and without bias, ragged output widths, at 1 and 2 threads; and still the product (against
float64). The default kernels fail the same check (1-4-row blocks split K over 2-4 accumulator
sets), so it can fail.

On AVX2 the padding the mode used before (to 5 rows) was not enough: 7 rows are two blocks of 4 + 3
there, each with 2 accumulator sets; the rows 7 and 13 below cover that."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.model.attention import cpu_op
from pagedllm.model.layers import cpu_gemm, quantized
from pagedllm.model.layers.quantized import Q4_0, Q4_1, Q6_K, Q8_0, QuantizedWeight
from tests.model.test_quant_kernels import K_QUANTS, quantized_weight

pytestmark = pytest.mark.skipif(not cpu_op.load(), reason="the mode needs the compiled CPU ops")

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 16, 29, 57, 64, 300)


def _isas() -> list[str]:
    if not cpu_op.load():
        return []
    return ["avx2"] + (["avx512"] if cpu_gemm.panel_width("avx512") else [])


def _rows_independent(product, x: torch.Tensor) -> None:
    """Every row of ``product(x[:m])`` equals ``product`` of that row alone, bitwise."""
    alone = torch.cat([product(x[i : i + 1]) for i in range(x.shape[0])])
    for m in ROWS:
        assert torch.equal(product(x[:m]), alone[:m]), f"{m} rows"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(x[:16])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone[:16]), "1 thread"


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("n,k,with_bias", [(37, 64, True), (200, 576, False), (512, 96, True), (16, 1000, False)])
def test_float32_gemm_rows_are_independent(isa, n, k, with_bias):
    from pagedllm.model import batch_invariant

    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = cpu_gemm.pack(w, isa)
    x = torch.randn(max(ROWS), k, generator=gen)
    _rows_independent(lambda part: batch_invariant.gemm(part, packed, bias, n), x)
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    got = batch_invariant.gemm(x, packed, bias, n).double()
    assert (got - ref).abs().max() <= k * 2.0**-23 * (x.double().abs() @ w.double().abs().t()).max() + 1e-5


@pytest.mark.parametrize("isa", [name for name in _isas() if quantized.kernel_available()])
@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_1, Q6_K])
@pytest.mark.parametrize("n", [37, 256])  # ragged (3 panels, the last 5 rows) and 16 whole panels
def test_quantized_gemm_rows_are_independent(isa, qtype, n, monkeypatch):
    from pagedllm.model import batch_invariant

    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", isa)
    k = 512 if qtype in K_QUANTS else 96
    qt, w_deq = quantized_weight(qtype, n, k, seed=n + qtype)
    weight = QuantizedWeight(qtype, qt.raw, k)
    gen = torch.Generator().manual_seed(n)
    bias = torch.randn(n, generator=gen) if n == 37 else None
    x = torch.randn(max(ROWS), k, generator=gen)
    _rows_independent(lambda part: batch_invariant.quant_gemm(part, weight, bias), x)
    ref = x.double().numpy() @ w_deq.astype(np.float64).T + (0 if bias is None else bias.double().numpy())
    scale = np.abs(x.double().numpy()) @ np.abs(w_deq.astype(np.float64)).T + 1.0
    err = np.abs(batch_invariant.quant_gemm(x, weight, bias).double().numpy() - ref) / scale
    assert err.max() < k * 2.0**-23


def test_the_default_kernels_are_not_row_independent():
    """Without the mode's kernels the check above fails: it can."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen)
    packed = cpu_gemm.pack(w)
    x = torch.randn(8, 256, generator=gen)
    with pytest.raises(AssertionError):
        _rows_independent(lambda part: cpu_gemm.gemm(part, packed, None, 64), x)
    if quantized.kernel_available():
        qt, _ = quantized_weight(Q4_1, 64, 256, seed=0)
        weight = QuantizedWeight(Q4_1, qt.raw, 256)
        with pytest.raises(AssertionError):
            _rows_independent(lambda part: weight.matmul(part), x)
