"""The quantized GEMM (csrc/quant_gemm*.cpp) against a float64 reference: the weight quantized and
dequantized with the gguf package's numpy code, then multiplied in float64. Ragged shapes (x rows
1..67, output rows not a multiple of the 16-row panel), both ISAs, bias, and the repack (every row
read back through ``dequantize_rows`` bit for bit). The gguf package cannot quantize to the
K-quants, so their blocks are random bytes with sane fp16 super-block scales (every bit pattern of
the sub-block scales and values is a valid block)."""

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pagedllm.model.layers import quantized
from pagedllm.model.layers.quantized import Q3_K, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, QuantizedWeight, QuantTensor

QTYPES = [Q8_0, Q4_0, Q4_1, Q3_K, Q4_K, Q5_K, Q6_K]
K_QUANTS = (Q3_K, Q4_K, Q5_K, Q6_K)
needs_kernel = pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")


def isas() -> list[str]:
    if not quantized.kernel_available():
        return []
    names = ["avx2"]
    if int(torch.ops.pagedllm.quant_gemm_isa(2)) == 2:
        names.append("avx512")
    return names


def d_offsets(qtype: int) -> tuple[int, ...]:
    """Where a K-quant block's fp16 super-block scale d (and Q4_K / Q5_K's dmin) sit."""
    return {Q3_K: (108,), Q6_K: (208,)}.get(qtype, (0, 2))


def random_k_quant(qtype: int, n: int, k: int, rng, scale=(1e-4, 1e-2)) -> np.ndarray:
    """Random K-quant rows ``[n, k / 256 * block bytes]``: random sub-block scales and values,
    fp16 super-block scales drawn from ``scale`` (some rows 40x)."""
    bb = quantized.GGUF_BLOCKS[qtype][1]
    blocks = rng.integers(0, 256, (n, k // 256, bb), dtype=np.uint8)
    big = np.where(rng.random((n, 1, 1)) < 0.1, 40.0, 1.0)
    for offset in d_offsets(qtype):
        d = (rng.uniform(*scale, (n, k // 256, 1)) * big).astype(np.float16)
        blocks[:, :, offset : offset + 2] = d.view(np.uint8)
    return blocks.reshape(n, -1)


def quantized_weight(qtype: int, n: int, k: int, seed: int) -> tuple[QuantTensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        raw = random_k_quant(qtype, n, k, rng)
        return QuantTensor(qtype, torch.from_numpy(raw), k), dequantize(raw, qtype).reshape(n, k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[rng.random(n) < 0.1] *= 40  # some rows with large scales
    raw = quantize(w, qtype)  # [n, k / 32 * block bytes] uint8
    return QuantTensor(qtype, torch.from_numpy(raw), k), dequantize(raw, qtype).reshape(n, k)


def reference(x: torch.Tensor, w_deq: np.ndarray, bias: torch.Tensor | None) -> np.ndarray:
    y = x.double().numpy() @ w_deq.astype(np.float64).T
    return y if bias is None else y + bias.double().numpy()


@pytest.mark.parametrize("qtype", QTYPES)
def test_repack_round_trips_every_row(qtype):
    k = 512 if qtype in K_QUANTS else 96
    qt, w_deq = quantized_weight(qtype, 37, k, seed=1)
    packed = quantized.repack(qtype, qt.raw)
    kernel_type = quantized.KERNEL_TYPE[qtype]
    assert packed.shape == (3, k // 32, quantized.PACKED_BLOCK_BYTES[kernel_type])
    rows = quantized.dequantize_rows(kernel_type, packed, torch.arange(37))
    assert torch.equal(rows, torch.from_numpy(w_deq))  # bit for bit gguf's float32
    some = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(quantized.dequantize_rows(kernel_type, packed, some), torch.from_numpy(w_deq[some.numpy()]))


def test_narrow_columns_in_whole_blocks_else_dequantized():
    qt, w_deq = quantized_weight(Q4_1, 8, 128, seed=2)
    part = qt.narrow(1, 64, 32)
    assert part.shape == (8, 32)
    assert torch.equal(part.materialize(), torch.from_numpy(w_deq[:, 64:96]))
    cut = qt.narrow(1, 16, 32)  # cuts a block: that shard comes dequantized
    assert isinstance(cut, torch.Tensor) and torch.equal(cut, torch.from_numpy(w_deq[:, 16:48]))
    qk, wk_deq = quantized_weight(Q6_K, 4, 768, seed=2)
    assert torch.equal(qk.narrow(1, 256, 512).materialize(), torch.from_numpy(wk_deq[:, 256:]))
    assert torch.equal(qk.narrow(1, 128, 256), torch.from_numpy(wk_deq[:, 128:384]))


@needs_kernel
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 64), (200, 576), (16, 96)])
def test_kernel_matches_float64_reference(qtype, isa, n, k, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", isa)
    if qtype in K_QUANTS:
        k = k // 32 * 256  # whole super-blocks
    qt, w_deq = quantized_weight(qtype, n, k, seed=n * 1000 + k)
    weight = QuantizedWeight(qtype, qt.raw, k)
    assert weight.isa == quantized.ISA_CODES[isa]
    gen = torch.Generator().manual_seed(n + k)
    for m in (1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 31, 64, 67):
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen) if m % 2 else None
        y = weight.matmul(x, bias)
        ref = reference(x, w_deq, bias)
        # float32 accumulation over k products: a bound of k * eps * sum |x w| (plus the bias add)
        scale = np.abs(x.double().numpy()) @ np.abs(w_deq.astype(np.float64)).T + 1.0
        err = np.abs(y.double().numpy() - ref) / scale
        assert y.shape == (m, n)
        assert err.max() < k * 2.0 ** -23, (m, err.max())


@needs_kernel
def test_kernel_strided_rows_and_bad_inputs():
    qt, w_deq = quantized_weight(Q4_0, 48, 64, seed=3)
    weight = QuantizedWeight(Q4_0, qt.raw, 64)
    base = torch.randn(5, 100)
    x = base[:, 10:74]  # row stride 100: read in place
    assert np.allclose(weight.matmul(x).numpy(), reference(x, w_deq, None), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 64)
    assert weight.matmul(x3).shape == (2, 3, 48)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.pagedllm.quant_gemm_cpu(torch.randn(1, 32), weight.packed, Q4_0, 48, None, 0)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.pagedllm.quant_gemm_cpu(torch.randn(1, 64), weight.packed, Q8_0, 48, None, 0)
