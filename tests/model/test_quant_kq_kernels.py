"""The K-quant int8-activation kernels (csrc/quant_gemm_kq*) against a float64 reference: gguf's numpy
dequantize of the weight times the activations as the op quantizes them (``quantize_activations``),
on both ISAs where this CPU has them; the file-size layout (``kquant.repack``) and its row lookup."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedllm.model.layers import kquant, quantized
from pagedllm.model.layers.quantized import Q3_K, Q4_K, Q5_K, Q6_K, QuantizedWeight
from tests.model.test_quant_kernels import d_offsets, random_k_quant

needs_kernel = pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable")
pytestmark = [needs_kernel, pytest.mark.usefixtures("int8_kernels_only")]
K_QUANTS = (Q3_K, Q4_K, Q5_K, Q6_K)


def isas() -> list[int]:
    """The ISA codes whose int8 kernel runs here (1 = AVX2, 2 = AVX-512 VNNI)."""
    if not quantized.int8_kernel_available():
        return []
    return [isa for isa in (1, 2) if int(torch.ops.pagedllm.quant_gemm_int8_isa(isa)) == isa]


def weight(qtype: int, raw: np.ndarray, k: int) -> QuantizedWeight:
    w = QuantizedWeight(qtype, torch.from_numpy(raw), k, int8_activations=True)
    assert w.kernel_type == kquant.KERNEL_TYPE[qtype]
    return w


def product(w: QuantizedWeight, x: torch.Tensor, isa: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.pagedllm.quant_gemm_cpu(x, w.packed, w.kernel_type, w.n, bias, isa)


def reference(x: torch.Tensor, raw: np.ndarray, qtype: int, n: int, k: int, bias=None) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound): y in float64 from the int8 activations the op forms and gguf's weights; bound, the
    sum of |terms| of each output (float32 accumulation error scales with it)."""
    q, d, _ = quantized.quantize_activations(x)
    x_hat = (q.double().view(x.shape[0], -1, 32) * d.double().unsqueeze(-1)).reshape(x.shape).numpy()
    w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    y = x_hat @ w.T
    if bias is not None:
        y = y + bias.double().numpy()
    return y, np.abs(x_hat) @ np.abs(w).T


def assert_close(y: torch.Tensor, ref: np.ndarray, bound: np.ndarray) -> None:
    err = np.abs(y.double().numpy() - ref)
    assert np.all(err <= 1e-5 * bound + 1e-30), float((err / (bound + 1e-30)).max())


@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize("n,k", [(40, 512), (19, 768)])
def test_kernel_matches_float64_reference(qtype, n, k):
    rng = np.random.default_rng(qtype * 100 + n)
    raw = random_k_quant(qtype, n, k, rng)
    w = weight(qtype, raw, k)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for m in (1, 3, 17, 64, 300):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        x[:, :32] *= 50  # one outlier block per row
        ref, bound = reference(x, raw, qtype, n, k, bias)
        for isa in isas():
            assert_close(product(w, x, isa, bias), ref, bound)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_saturation_extremes(qtype):
    """Every quant at its largest (15 / 31 / 63; Q3_K's 7, every hmask bit set), every 6-bit scale and min at
    63 (Q6_K's int8 scales at 127 and -128, Q3_K's at 31 and -32), activations at +-127: the AVX2 int16 pair
    sums stay unsaturated."""
    n, k = 32, 512
    bb = kquant.GGUF_BYTES[qtype]
    blocks = np.full((n, k // 256, bb), 0xFF, dtype=np.uint8)
    for offset in d_offsets(qtype):
        blocks[:, :, offset : offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype == Q6_K:
        blocks[::2, :, 192:208] = np.uint8(0x80)  # scales -128 and 127 on alternate rows
        blocks[1::2, :, 192:208] = np.uint8(0x7F)
    if qtype == Q3_K:
        blocks[::2, :, 96:108] = 0  # 6-bit scales 0: sc - 32 = -32 on alternate rows (31 on the others)
    raw = blocks.reshape(n, -1)
    w = weight(qtype, raw, k)
    signs = np.where(np.arange(k) % 3 == 0, -1.0, 1.0).astype(np.float32)
    x = torch.from_numpy(np.stack([np.ones(k, np.float32), -np.ones(k, np.float32), signs]))
    ref, bound = reference(x, raw, qtype, n, k)
    assert np.abs(ref).max() > 0
    for isa in isas():
        assert_close(product(w, x, isa), ref, bound)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_zero_scales_give_zeros_and_the_bias(qtype):
    n, k = 20, 256
    rng = np.random.default_rng(5)
    raw = random_k_quant(qtype, n, k, rng).reshape(n, 1, -1)
    for offset in d_offsets(qtype):
        raw[:, :, offset : offset + 2] = 0
    w = weight(qtype, raw.reshape(n, -1), k)
    bias = torch.arange(n, dtype=torch.float32)
    x = torch.randn(5, k)
    for isa in isas():
        assert torch.equal(product(w, x, isa, bias), bias.expand(5, n))


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_a_row_alone_equals_it_in_a_batch(qtype):
    """The same bits for a row alone as in a batch of 64 (its float sums' order does not depend on the
    row count): the engine's results stay independent of the batch."""
    n, k = 48, 512
    rng = np.random.default_rng(11)
    w = weight(qtype, random_k_quant(qtype, n, k, rng), k)
    x = torch.from_numpy(rng.standard_normal((64, k)).astype(np.float32))
    for isa in isas():
        batch = product(w, x, isa)
        for i in (0, 5, 17, 63):
            assert torch.equal(product(w, x[i : i + 1], isa)[0], batch[i])
        assert torch.equal(product(w, x[7:10], isa), batch[7:10])


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_held_at_the_files_size(qtype):
    n, k = 64, 1024
    raw = random_k_quant(qtype, n, k, np.random.default_rng(2))
    held = weight(qtype, raw, k).nbytes
    assert held <= 1.05 * raw.size, (held, raw.size)
    expanded = QuantizedWeight(qtype, torch.from_numpy(raw), k)  # the float-activation path's QX: 12 bits a weight
    assert expanded.kernel_type == quantized.QX and expanded.nbytes == n * k * 3 // 2


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_rows_equal_gguf_dequantize_bit_for_bit(qtype):
    n, k = 35, 512  # a partial last panel
    raw = random_k_quant(qtype, n, k, np.random.default_rng(3))
    w = weight(qtype, raw, k)
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    ids = torch.tensor([0, 34, 15, 16, 7, 7, 33])
    assert torch.equal(w.rows(ids), expected[ids])
    assert torch.equal(w.rows(torch.arange(n)), expected)


def test_float_activations_keep_the_expanded_layout():
    raw = random_k_quant(Q4_K, 16, 256, np.random.default_rng(4))
    w = QuantizedWeight(Q4_K, torch.from_numpy(raw), 256)
    assert w.kernel_type == quantized.QX
    assert w.use_int8_activations() is False and w.kernel_type == quantized.QX


def test_bad_packed_shape_is_refused():
    raw = random_k_quant(Q6_K, 16, 512, np.random.default_rng(6))
    w = weight(Q6_K, raw, 512)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.pagedllm.quant_gemm_cpu(torch.randn(2, 256), w.packed, w.kernel_type, 16, None, 0)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.pagedllm.quant_gemm_invariant_cpu(torch.randn(2, 256), w.packed, w.kernel_type, 16, None, 0)


@pytest.mark.parametrize("qtype", [Q3_K, Q4_K, Q6_K, quantized.Q4_0])
def test_rows_past_one_tile(qtype):
    """300 rows of K = 2048 span three tiles of x (csrc/panel_tiles.h): each row still equals itself
    alone and the reference (the Q4_0 int8 kernel shares the tiling)."""
    n, k = 24, 2048
    rng = np.random.default_rng(12)
    if qtype == quantized.Q4_0:
        raw = quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
        w = QuantizedWeight(qtype, torch.from_numpy(raw.copy()), k)
        assert w.use_int8_activations()
    else:
        raw = random_k_quant(qtype, n, k, rng)
        w = weight(qtype, raw, k)
    x = torch.from_numpy(rng.standard_normal((300, k)).astype(np.float32))
    ref, bound = reference(x, raw, qtype, n, k)
    for isa in isas():
        batch = product(w, x, isa)
        assert_close(batch, ref, bound)
        for i in (0, 130, 299):
            assert torch.equal(product(w, x[i : i + 1], isa)[0], batch[i])


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_compiled_and_numpy_row_lookups_agree(qtype):
    n, k = 40, 768
    raw = random_k_quant(qtype, n, k, np.random.default_rng(8))
    w = weight(qtype, raw, k)
    ids = torch.tensor([39, 0, 17, 17, 32])
    compiled = quantized.dequantize_rows(w.kernel_type, w.packed, ids)
    assert torch.equal(compiled, kquant.rows(w.kernel_type, w.packed, ids))
    expected = dequantize(raw, qtype).reshape(n, k)[ids.numpy()]
    assert torch.equal(compiled, torch.from_numpy(expected))


@torch.inference_mode()
def test_k_quant_experts_take_the_file_size_layout():
    """MoE experts hold QuantizedWeights: marked for int8 activations, their K-quants take the layout too."""
    from pagedllm.model.layers.moe import SparseMoE
    from tests.model.test_moe import EXPERTS, TOP_K, _quantized_checkpoint, _q_layer

    quant_w, float_w = _quantized_checkpoint(GGMLQuantizationType.Q4_K, 256, 256)
    moe = SparseMoE(256, 256, EXPERTS, TOP_K, renormalize=True)
    moe.gate.weight.data.copy_(quant_w["gate"])
    w13, w2 = moe.experts.w13, moe.experts.w2
    quantized.mark_int8_activations(w13)
    quantized.mark_int8_activations(w2)
    for e in range(EXPERTS):
        w13.weight_loader(w13, quant_w[f"{e}.gate_proj"], (e, 0))
        w13.weight_loader(w13, quant_w[f"{e}.up_proj"], (e, 1))
        w2.weight_loader(w2, quant_w[f"{e}.down_proj"], (e,))
    moe.experts.process_weights_after_loading()
    assert {w.kernel_type for ws in moe.experts.quant for w in ws} == {kquant.KERNEL_TYPE[Q4_K]}
    file_bytes = sum(t.raw.numel() for name, t in quant_w.items() if name != "gate")
    assert moe.experts.quantized_nbytes <= 1.05 * file_bytes
    floats = _q_layer(float_w)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(7))
    want = floats(x)
    # int8 activations: ~1% of the output's norm here; a wrong layout is off by all of it
    assert float((moe(x) - want).norm()) < 0.03 * float(want.norm())

