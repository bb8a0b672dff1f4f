"""The Q5_0 / Q5_1 / IQ4_NL int8-activation kernels (csrc/quant_gemm_int8*) against a float64 reference: gguf's
numpy dequantize of the weight times the activations as the op quantizes them, on both ISAs where this CPU has
them; the file-size layouts (``q5.repack``, ``iq4nl.repack``), their row lookups (compiled and numpy) bit for bit
gguf's, and the exact mode's QX expansion."""

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pagedllm.model.layers import quantized
from pagedllm.model.layers.quant_layout import IQ4_NL
from pagedllm.model.layers.quant_weight import AT_FILE_SIZE
from pagedllm.model.layers.quantized import Q5_0, Q5_1, QuantizedWeight
from tests.model.test_quant_kq_kernels import assert_close, isas, product, reference

needs_kernel = pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable")
pytestmark = [needs_kernel, pytest.mark.usefixtures("int8_kernels_only")]
TYPES = (Q5_0, Q5_1, IQ4_NL)
SCALE_BYTES = {Q5_0: 2, Q5_1: 4, IQ4_NL: 2}
"""The fp16 d (and Q5_1's m) at the start of each block."""


def random_blocks(qtype: int, n: int, k: int, rng, scale=(1e-4, 1e-2)) -> np.ndarray:
    """Random rows ``[n, k / 32 * block bytes]``: every bit pattern of the codes (and fifth bits), fp16 d (and
    Q5_1's m, either sign) drawn from ``scale`` (some rows 40x)."""
    bb = quantized.GGUF_BLOCKS[qtype][1]
    blocks = rng.integers(0, 256, (n, k // 32, bb), dtype=np.uint8)
    big = np.where(rng.random((n, 1, 1)) < 0.1, 40.0, 1.0)
    blocks[:, :, 0:2] = (rng.uniform(*scale, (n, k // 32, 1)) * big).astype(np.float16).view(np.uint8)
    if qtype == Q5_1:
        m = rng.uniform(*scale, (n, k // 32, 1)) * big * rng.choice([-16.0, 16.0], (n, k // 32, 1))
        blocks[:, :, 2:4] = m.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def weight(qtype: int, raw: np.ndarray, k: int) -> QuantizedWeight:
    w = QuantizedWeight(qtype, torch.from_numpy(raw), k, int8_activations=True)
    assert w.kernel_type == AT_FILE_SIZE[qtype].KERNEL_TYPE[qtype]
    return w


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(40, 512), (19, 96), (16, 896)])
def test_kernel_matches_float64_reference(qtype, n, k):
    rng = np.random.default_rng(qtype * 100 + n)
    raw = random_blocks(qtype, n, k, rng)
    w = weight(qtype, raw, k)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for m in (1, 2, 3, 5, 9, 17, 64, 300):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        x[:, :32] *= 50  # one outlier block per row
        ref, bound = reference(x, raw, qtype, n, k, bias)
        for isa in isas():
            assert_close(product(w, x, isa, bias), ref, bound)


@pytest.mark.parametrize("qtype", TYPES)
def test_saturation_extremes(qtype):
    """Every code at its largest (Q5: 31, all nibbles and fifth bits set; IQ4_NL: index 15, 113) on some rows and
    0 on others (IQ4_NL: -127), activations at +-127: the AVX2 int16 pair sums (31 x 127 x 2; IQ4_NL's 127 x 127 x 2
    through the sign trick) stay unsaturated, and Q5_0's -16 start is taken at both ends."""
    n, k = 32, 512
    bb = quantized.GGUF_BLOCKS[qtype][1]
    blocks = np.full((n, k // 32, bb), 0xFF, dtype=np.uint8)
    blocks[1::2, :, SCALE_BYTES[qtype] :] = 0  # the codes of alternate rows: 0
    blocks[:, :, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype == Q5_1:
        blocks[:, :, 2:4] = np.array([-0.5], dtype=np.float16).view(np.uint8)
    raw = blocks.reshape(n, -1)
    w = weight(qtype, raw, k)
    signs = np.where(np.arange(k) % 3 == 0, -1.0, 1.0).astype(np.float32)
    x = torch.from_numpy(np.stack([np.ones(k, np.float32), -np.ones(k, np.float32), signs]))
    ref, bound = reference(x, raw, qtype, n, k)
    assert np.abs(ref).max() > 0
    for isa in isas():
        assert_close(product(w, x, isa), ref, bound)


@pytest.mark.parametrize("qtype", TYPES)
def test_zero_scales_give_zeros_and_the_bias(qtype):
    n, k = 20, 256
    raw = random_blocks(qtype, n, k, np.random.default_rng(5)).reshape(n, k // 32, -1)
    raw[:, :, 0 : SCALE_BYTES[qtype]] = 0  # d (and m)
    w = weight(qtype, raw.reshape(n, -1), k)
    bias = torch.arange(n, dtype=torch.float32)
    x = torch.randn(5, k)
    for isa in isas():
        assert torch.equal(product(w, x, isa, bias), bias.expand(5, n))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_alone_equals_it_in_a_batch(qtype):
    """The same bits for a row alone as in a batch of 64 (and through the batch-invariant call)."""
    n, k = 48, 512
    rng = np.random.default_rng(11)
    w = weight(qtype, random_blocks(qtype, n, k, rng), k)
    x = torch.from_numpy(rng.standard_normal((64, k)).astype(np.float32))
    for isa in isas():
        batch = product(w, x, isa)
        for i in (0, 5, 17, 63):
            assert torch.equal(product(w, x[i : i + 1], isa)[0], batch[i])
        assert torch.equal(product(w, x[7:10], isa), batch[7:10])
        invariant = torch.ops.pagedllm.quant_gemm_invariant_cpu(x, w.packed, w.kernel_type, w.n, None, isa)
        assert torch.equal(invariant, batch)


@pytest.mark.parametrize("qtype", TYPES)
def test_held_at_the_files_size(qtype):
    n, k = 64, 1024
    raw = random_blocks(qtype, n, k, np.random.default_rng(2))
    assert weight(qtype, raw, k).nbytes == raw.size  # 16 rows' blocks are 16 GGUF blocks' bytes exactly
    expanded = QuantizedWeight(qtype, torch.from_numpy(raw), k)  # the exact mode's QX: 12 bits a weight
    assert expanded.kernel_type == quantized.QX and expanded.nbytes == n * k * 3 // 2
    assert expanded.use_int8_activations() is False and expanded.kernel_type == quantized.QX


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_equal_gguf_dequantize_bit_for_bit(qtype):
    n, k = 35, 512  # a partial last panel
    raw = random_blocks(qtype, n, k, np.random.default_rng(3))
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    ids = torch.tensor([0, 34, 15, 16, 7, 7, 33])
    for w in (weight(qtype, raw, k), QuantizedWeight(qtype, torch.from_numpy(raw), k)):  # int8 layout, QX
        assert torch.equal(w.rows(ids), expected[ids])
        assert torch.equal(w.rows(torch.arange(n)), expected)
    w = weight(qtype, raw, k)
    compiled = quantized.dequantize_rows(w.kernel_type, w.packed, ids)
    assert torch.equal(compiled, AT_FILE_SIZE[qtype].rows(w.kernel_type, w.packed, ids))
    assert torch.equal(compiled, expected[ids])


@pytest.mark.parametrize("qtype", TYPES)
def test_exact_mode_equals_the_dequantized_weight(qtype):
    """Float activations (QX panels): the product is x times gguf's float32 weights, up to float32 sums."""
    n, k = 33, 256
    rng = np.random.default_rng(9)
    raw = random_blocks(qtype, n, k, rng)
    w = QuantizedWeight(qtype, torch.from_numpy(raw), k)
    x = torch.from_numpy(rng.standard_normal((6, k)).astype(np.float32))
    dense = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    ref = x.double().numpy() @ dense.T
    assert_close(w.matmul(x), ref, np.abs(x.double().numpy()) @ np.abs(dense).T)


@pytest.mark.parametrize("qtype", (Q5_0, Q5_1))  # (gguf has no IQ4_NL quantizer)
def test_quantized_weights_near_the_float_ones(qtype):
    """gguf's own quantizer's bytes (not random ones): int8 activations keep the product within ~1% of the float
    product, as for Q4_0 / Q4_1."""
    n, k = 64, 896
    rng = np.random.default_rng(10)
    dense = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w = weight(qtype, quantize(dense, qtype), k)
    x = torch.from_numpy(rng.standard_normal((4, k)).astype(np.float32))
    want = x @ torch.from_numpy(dense).T
    assert float((w.matmul(x) - want).norm()) < 0.05 * float(want.norm())
