"""A fused weight whose rows come in several GGUF types (a Q4_K_M file's q/k in Q4_K, v in Q6_K) stays
quantized part by part: held at the file's size, its product the parts' products side by side."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.model import batch_invariant
from pagedllm.model.layers import quantized
from pagedllm.model.layers.quant_groups import QuantizedRowGroups
from pagedllm.model.layers.quantized import Q4_0, Q4_K, Q6_K, QuantizedWeight, QuantTensor
from tests.model.test_quant_kernels import quantized_weight, random_k_quant

pytestmark = pytest.mark.skipif(not quantized.kernel_available(), reason="the compiled quantized kernel is unavailable")
K = 512


def _staged(int8: bool, parts) -> tuple[nn.Parameter, list[np.ndarray]]:
    """A [sum rows, K] parameter staged as the loader stages a fused q/k/v: one shard per part."""
    rows = sum(p[1].shape[0] for p in parts)
    param = nn.Parameter(torch.empty(rows, K), requires_grad=False)
    if int8:
        quantized.mark_int8_activations(param)
    offset = 0
    for qtype, raw in parts:
        quantized.stage(param, offset, QuantTensor(qtype, torch.from_numpy(raw), K))
        offset += raw.shape[0]
    return param, [QuantTensor(q, torch.from_numpy(r), K).materialize().numpy() for q, r in parts]


@pytest.mark.parametrize("int8", [False, True])
def test_mixed_rows_stay_quantized_and_multiply_as_their_parts(int8):
    rng = np.random.default_rng(0)
    parts = [(Q4_K, random_k_quant(Q4_K, 48, K, rng)), (Q4_K, random_k_quant(Q4_K, 16, K, rng)),
             (Q6_K, random_k_quant(Q6_K, 16, K, rng))]  # q, k, v
    param, dense = _staged(int8, parts)
    weight = quantized.finalize(param)
    assert isinstance(weight, QuantizedRowGroups) and len(weight.groups) == 2  # the two Q4_K shards are one run
    assert weight.n == 80 and param.shape == (80, 0)
    file_bytes = sum(raw.nbytes for _, raw in parts)
    assert weight.nbytes <= 1.05 * file_bytes if int8 else weight.nbytes > file_bytes  # QX: 12 bits a weight
    x = torch.randn(5, K)
    bias = torch.randn(80)
    y = weight.matmul(x, bias)
    expected = torch.cat([g.matmul(x, bias[s:s + g.n]) for g, s in zip(weight.groups, (0, 64))], dim=-1)
    assert torch.equal(y, expected)
    reference = x.double() @ torch.from_numpy(np.concatenate(dense)).double().T + bias.double()
    tolerance = 0.05 if int8 else 1e-4  # int8 activations: their rounding; float: summation order
    assert float((y.double() - reference).abs().max()) <= tolerance * float(reference.abs().max())


def test_the_batch_invariant_product_goes_group_by_group():
    rng = np.random.default_rng(1)
    param, _ = _staged(True, [(Q4_K, random_k_quant(Q4_K, 32, K, rng)), (Q6_K, random_k_quant(Q6_K, 16, K, rng))])
    weight = quantized.finalize(param)
    x = torch.randn(7, K)
    alone = batch_invariant.quant_gemm(x[3:4].contiguous(), weight, None)
    batched = batch_invariant.quant_gemm(x, weight, None)
    assert torch.equal(alone[0], batched[3])


def test_int8_activations_switch_every_group_that_has_the_kernel():
    rng = np.random.default_rng(2)
    q4_0, _ = quantized_weight(Q4_0, 16, K, seed=2)
    groups = QuantizedRowGroups([QuantizedWeight(Q4_0, q4_0.raw, K),
                                 QuantizedWeight(Q6_K, torch.from_numpy(random_k_quant(Q6_K, 16, K, rng)), K)])
    if not quantized.int8_kernel_available():
        pytest.skip("the int8-activation kernel is unavailable")
    assert groups.use_int8_activations()
    assert groups.groups[0].kernel_type == quantized.INT8_KERNEL_TYPE[quantized.Q4_0]
