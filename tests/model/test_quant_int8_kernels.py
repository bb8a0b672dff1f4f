"""The int8-activation quantized GEMM (csrc/quant_gemm_int8*.cpp, ``--quant-activations int8``).

The kernel is checked against float64 computed from the same int8 activations (``quantize_activations``)
and the GGUF blocks' exact integers and fp16 scales: integer dot products are exact, so the only
difference is float32's scaling and summing over K-blocks, and the bound is tight. The quantizer is
checked bit for bit against numpy. Ragged shapes (rows 1..130, K a multiple of 32 but not of 256, N not
a multiple of 16), both ISAs, bias, the extremes that would overflow AVX2's int16 pair sums."""

import numpy as np
import pytest
import torch
from gguf.quants import quantize

from pagedllm.model.layers import quantized
from pagedllm.model.layers.quantized import Q4_0, Q4_1, Q4_K, Q8_0, QuantizedWeight

INT8_TYPES = [Q8_0, Q4_0, Q4_1]
needs_kernel = pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable")

pytestmark = pytest.mark.usefixtures("int8_kernels_only")  # the int8 kernels at every row count


def isas() -> list[str]:
    if not quantized.int8_kernel_available():
        return []
    names = ["avx2"]
    if int(torch.ops.pagedllm.quant_gemm_int8_isa(2)) == 2:
        names.append("avx512")  # AVX-512 VNNI
    return names


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's form of the kernel's activation quantizer, in the same float32 operations."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int8)
    d = (amax / np.float32(127)).astype(np.float32)[..., 0]
    return q.reshape(m, k), d, q.astype(np.int32).sum(axis=-1)


def exact_weight(qtype: int, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The weight ``[n, k]`` in float64 from the GGUF blocks' integers and fp16 scales, exactly (gguf's
    numpy dequantize rounds Q4_1's d q + m to float32; the int8 kernel never forms that float)."""
    bb = quantized.GGUF_BLOCKS[qtype][1]
    blocks = raw.reshape(n, k // 32, bb)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)  # [n, nb, 1]
    if qtype == Q8_0:
        return (blocks[..., 2:].view(np.int8).astype(np.float64) * d).reshape(n, k)
    start = 4 if qtype == Q4_1 else 2
    b = blocks[..., start:]
    q = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.float64)  # k = j low nibble, j + 16 high
    if qtype == Q4_0:
        return ((q - 8) * d).reshape(n, k)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    return (q * d + m).reshape(n, k)


def random_raw(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[rng.random(n) < 0.1] *= 40  # some rows with large scales
    return quantize(w, qtype)


def check(weight: QuantizedWeight, w64: np.ndarray, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    q, d, _ = quantized.quantize_activations(x)
    m, k = x.shape
    x64 = (q.numpy().astype(np.float64).reshape(m, k // 32, 32) * d.numpy()[..., None].astype(np.float64)).reshape(m, k)
    ref = x64 @ w64.T + (0.0 if bias is None else bias.double().numpy())
    y = weight.matmul(x, bias)
    assert y.shape == (m, w64.shape[0]) and y.dtype == torch.float32
    # float32 scaling and summing over the K / 32 blocks: a bound of (blocks + 2) eps sum |x w| (+ bias)
    scale = np.abs(x64) @ np.abs(w64).T + (0.0 if bias is None else np.abs(bias.double().numpy())) + 1e-30
    err = np.abs(y.double().numpy() - ref) / scale
    assert err.max() < (k // 32 + 2) * 2.0 ** -23, (m, err.max())


@needs_kernel
def test_quantizer_matches_numpy_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(7, 200, generator=gen) * torch.logspace(-6, 3, 200)
    base[2, 40:72] = 0.0  # an all-zero block: scale 0, every q 0
    base[3, 8:40] = 1.0  # a constant block: every q 127
    base[4, 8] = 2.5 / 127 * 1.0  # near ties of round-half-to-even
    x = base[:, 8:168]  # K = 160, row stride 200: read in place
    q, d, s = quantized.quantize_activations(x)
    rq, rd, rs = quantize_reference(x.numpy())
    assert q.dtype == torch.int8 and d.dtype == torch.float32 and s.dtype == torch.int32
    assert np.array_equal(q.numpy(), rq) and np.array_equal(d.numpy(), rd) and np.array_equal(s.numpy(), rs)
    assert int(q.abs().max()) == 127 and d[2, 1] == 0 and (q[2, 32:64] == 0).all()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quantized.quantize_activations(torch.randn(2, 48))


@needs_kernel
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (200, 288), (16, 64)])
def test_kernel_matches_float64_on_the_same_int8_activations(qtype, isa, n, k, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", isa)
    raw = random_raw(qtype, n, k, seed=n * 1000 + k)
    weight = QuantizedWeight(qtype, torch.from_numpy(raw), k)
    assert weight.use_int8_activations()
    assert weight.kernel_type == quantized.INT8_KERNEL_TYPE[qtype] and weight.isa == quantized.ISA_CODES[isa]
    w64 = exact_weight(qtype, raw, n, k)
    gen = torch.Generator().manual_seed(n + k)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 64, 127, 130):
        x = torch.randn(m, k, generator=gen)
        check(weight, w64, x, torch.randn(n, generator=gen) if m % 2 else None)


@needs_kernel
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_extremes_do_not_saturate(qtype, isa, monkeypatch):
    """Every weight at its type's extreme (Q8_0: -128 and 127, which the gguf quantizer never writes but
    a file may hold; Q4: nibbles 0 and 15) against activations of +-127: the largest pair sums."""
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", isa)
    n, k = 20, 64
    raw = random_raw(qtype, n, k, seed=5).reshape(n, k // 32, -1)
    rng = np.random.default_rng(6)
    start = 4 if qtype == Q4_1 else 2
    if qtype == Q8_0:
        raw[..., start:] = rng.choice(np.array([-128, 127, -127], dtype=np.int8), raw[..., start:].shape).view(np.uint8)
    else:
        raw[..., start:] = rng.choice(np.array([0x00, 0xFF, 0x0F, 0xF0], dtype=np.uint8), raw[..., start:].shape)
    raw = np.ascontiguousarray(raw.reshape(n, -1))
    weight = QuantizedWeight(qtype, torch.from_numpy(raw), k)
    assert weight.use_int8_activations()
    x = torch.from_numpy(rng.choice(np.array([-1.0, 1.0], dtype=np.float32), (9, k)))  # every q is +-127
    check(weight, exact_weight(qtype, raw, n, k), x, None)


@needs_kernel
def test_layout_is_replaced_and_other_types_keep_the_float_path():
    raw = random_raw(Q4_1, 40, 96, seed=7)
    weight = QuantizedWeight(Q4_1, torch.from_numpy(raw), 96)
    before, data_ptr = weight.packed.clone(), weight.packed.data_ptr()
    assert weight.use_int8_activations()
    assert weight.packed.data_ptr() == data_ptr and weight.packed.shape == before.shape  # in place, one copy
    assert torch.equal(weight.packed[..., :64], before[..., :64])  # the scales and mins where they were
    assert not torch.equal(weight.packed, before)
    # the same bytes, only reordered: [byte j][16 rows] -> [j / 4][16 rows][j % 4]
    reordered = before[..., 64:].view(3, 3, 4, 4, 16).transpose(3, 4)
    assert torch.equal(weight.packed[..., 64:].view(3, 3, 4, 16, 4), reordered)
    with pytest.raises(NotImplementedError):
        weight.rows(torch.arange(3))
    x = torch.randn(1, 96)  # the invariant call runs the int8 kernel as it is (invariant already)
    assert torch.equal(torch.ops.pagedllm.quant_gemm_invariant_cpu(x, weight.packed, weight.kernel_type, 40, None, 0),
                       torch.ops.pagedllm.quant_gemm_cpu(x, weight.packed, weight.kernel_type, 40, None, 0))
    from tests.model.test_quant_kernels import random_k_quant  # a K-quant: no int8 kernel, stays as it is

    kq = random_k_quant(Q4_K, 16, 256, np.random.default_rng(8))
    k_weight = QuantizedWeight(Q4_K, torch.from_numpy(kq), 256)
    packed = k_weight.packed.clone()
    assert not k_weight.use_int8_activations()
    assert k_weight.kernel_type == quantized.QX and torch.equal(k_weight.packed, packed)


def test_engine_args_default_to_auto_and_refuse_an_int8_that_cannot_run():
    from pagedllm.config import EngineArgs

    assert EngineArgs().quant_activations == "auto"
    # batch invariance and tensor parallelism take int8 activations (tests/engine, tests/model/test_quant_tp.py)
    EngineArgs(quant_activations="int8", batch_invariant=True)
    EngineArgs(quant_activations="int8", tensor_parallel_size=2)
    EngineArgs(dtype="bfloat16")  # auto falls back to float activations there, quietly
    with pytest.raises(ValueError, match="quant_activations 'int8' applies to float32 CPU models"):
        EngineArgs(quant_activations="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quant_activations 'int8' applies to float32 CPU models"):
        EngineArgs(quant_activations="int8", device="cuda")
    with pytest.raises(ValueError, match="quant_activations"):
        EngineArgs(quant_activations="int4")
