"""The bf16 prefill path of the int8-activation types (csrc/quant_dequant_bf16.cpp, csrc/quant_gemm_op.cpp): on a
CPU with AMX-BF16 a call of many rows unpacks the weight to bf16 and multiplies through oneDNN's AMX ukernel. The
unpacked weight equals the gguf package's float32 dequantization rounded to bf16, bit for bit, for every type and
a ragged row count; the product is that bf16 product summed in float32 (against float64, within bf16's rounding)
for every type, ragged row and column counts and with a bias; calls below the row threshold and the
batch-invariant call keep the int8 kernels, bit for bit; the threshold's setter and its environment variable
refuse what they cannot take."""

import numpy as np
import pytest
import torch
from gguf.quants import quantize

from pagedllm import envs
from pagedllm.model.layers import quantized
from pagedllm.model.layers.quant_layout import IQ4_NL
from pagedllm.model.layers.quantized import (Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QuantizedWeight,
                                             QuantTensor)
from tests.model.test_quant_kernels import random_k_quant
from tests.model.test_quant_q5_iq4nl_kernels import random_blocks


def _has_bf16_path() -> bool:
    if not (quantized.kernel_available() and hasattr(torch.ops.pagedllm, "dequant_bf16_cpu")):
        return False
    caps = torch._C._cpu._get_cpu_capability()
    return bool(caps.get("avx512_bf16"))


def _has_amx_ukernel() -> bool:
    return _has_bf16_path() and bool(torch.ops.pagedllm.bf16_matmul_available())


pytestmark = pytest.mark.skipif(not _has_bf16_path(), reason="the bf16 path needs the compiled library and "
                                "AVX-512 BF16")
needs_amx = pytest.mark.skipif(not _has_amx_ukernel(), reason="the bf16 product needs AMX-BF16 (ATen's ukernel)")
QTYPES = [Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q3_K, Q4_K, Q5_K, Q6_K]


def int8_weight(qtype: int, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A weight on the int8-activation kernel and its float32 dequantization by the gguf package."""
    rng = np.random.default_rng(seed)
    if qtype in (Q3_K, Q4_K, Q5_K, Q6_K):
        raw = random_k_quant(qtype, n, k, rng)
    elif qtype == IQ4_NL:  # (gguf has no IQ4_NL quantizer)
        raw = random_blocks(qtype, n, k, rng)
    else:
        raw = quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    weight = QuantizedWeight(qtype, torch.from_numpy(raw), k, int8_activations=True)
    assert weight.use_int8_activations()
    return weight, QuantTensor(qtype, torch.from_numpy(raw), k).materialize()


@pytest.fixture
def bf16_rows():
    """Sets the threshold for one test; restores it after."""
    previous = int(torch.ops.pagedllm.quant_gemm_bf16_rows(-1))
    yield lambda rows: torch.ops.pagedllm.quant_gemm_bf16_rows(rows)
    torch.ops.pagedllm.quant_gemm_bf16_rows(previous)


@pytest.mark.parametrize("qtype", QTYPES)
def test_unpacked_weight_is_the_float_dequantization_rounded_to_bf16(qtype):
    weight, dense = int8_weight(qtype, 37, 512, seed=qtype)
    unpacked = torch.ops.pagedllm.dequant_bf16_cpu(weight.packed, weight.kernel_type, weight.n)
    assert unpacked.dtype == torch.bfloat16 and unpacked.shape == (37, 512)
    assert torch.equal(unpacked, dense.to(torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("m, n, k", [(70, 96, 512), (64, 64, 512), (300, 200, 512), (700, 16, 512),
                                     (1030, 130, 512), (130, 300, 4352)])
def test_every_row_and_column_is_its_own_bf16_product(m, n, k, bf16_rows):
    """Row counts below, at and past one ukernel call (64 rows) and one chunk (512 rows), column counts that end
    inside a 64-column block or a 16-row panel, a K summed in steps of 2048 and a remainder: each row's result is
    that row's bf16 product, none shifted or left unwritten, and the same whether the row is multiplied with the
    others or alone."""
    weight, dense = int8_weight(Q4_K, n, k, seed=3)
    x = torch.randn(m, k)
    bf16_rows(64)
    y = weight.matmul(x, None)
    expected = x.to(torch.bfloat16).double() @ dense.to(torch.bfloat16).double().T
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    starts = [0, min(m // 2, m - 64), m - 64]  # 64-row calls: the threshold's, so they take the same path
    alone = torch.stack([weight.matmul(x[i:i + 64], None)[0] for i in starts])
    torch.testing.assert_close(y[starts], alone, rtol=0, atol=1e-5 * float(expected.abs().max()))
    wide = torch.cat([x, torch.randn(m, 5)], dim=1)  # strided rows
    assert torch.equal(weight.matmul(wide[:, :k], None), y)
    threads = torch.get_num_threads()
    try:  # each thread rounds its share of the rows: the split changes no bit
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(weight.matmul(x, None), y), count
    finally:
        torch.set_num_threads(threads)


@needs_amx
@pytest.mark.parametrize("qtype", QTYPES)
def test_many_rows_take_the_bf16_product(qtype, bf16_rows):
    weight, dense = int8_weight(qtype, 200, 512, seed=10 + qtype)
    x = torch.randn(70, 512)
    bias = torch.randn(200)
    bf16_rows(0)
    int8 = weight.matmul(x, bias)
    bf16_rows(64)
    y = weight.matmul(x, bias)
    expected = x.to(torch.bfloat16).double() @ dense.to(torch.bfloat16).double().T + bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    reference = x.double() @ dense.double().T + bias.double()
    scale = float(reference.abs().max())
    assert float((y.double() - reference).abs().max()) <= 0.02 * scale  # bf16's rounding, a few parts in 1000
    assert not torch.equal(y, int8)  # another rounding: the path was taken
    assert float((int8.double() - reference).abs().max()) <= 0.05 * scale


@needs_amx
def test_fewer_rows_and_the_invariant_call_keep_the_int8_kernel(bf16_rows):
    weight, _ = int8_weight(Q4_K, 48, 256, seed=3)
    x = torch.randn(40, 256)
    bf16_rows(0)
    int8 = weight.matmul(x)
    bf16_rows(41)  # 40 rows: below the threshold
    assert torch.equal(weight.matmul(x), int8)
    bf16_rows(1)
    invariant = torch.ops.pagedllm.quant_gemm_invariant_cpu(x, weight.packed, weight.kernel_type, weight.n, None,
                                                             weight.isa)
    assert torch.equal(invariant, int8)
    assert not torch.equal(weight.matmul(x), int8)
    bf16_rows(2)
    assert torch.equal(weight.matmul(x[7:8]), int8[7:8])  # a decode row: the int8 kernel's own rounding


@needs_amx
def test_the_threshold_setter_and_variable_refuse_what_they_cannot_take(bf16_rows, monkeypatch):
    before = int(torch.ops.pagedllm.quant_gemm_bf16_rows(-1))
    assert int(bf16_rows(300)) == before
    assert int(torch.ops.pagedllm.quant_gemm_bf16_rows(-1)) == 300
    with pytest.raises(RuntimeError, match="not an int8-activation type"):
        torch.ops.pagedllm.dequant_bf16_cpu(torch.zeros(1, 1, 18, dtype=torch.uint8), 2, 16)
    monkeypatch.setenv("PAGEDLLM_BF16_PREFILL_ROWS", "many")
    with pytest.raises(ValueError, match="PAGEDLLM_BF16_PREFILL_ROWS"):
        envs.check_compiled_op_env()
    monkeypatch.setenv("PAGEDLLM_BF16_PREFILL_ROWS", "0")
    envs.check_compiled_op_env()
