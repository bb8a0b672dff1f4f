"""The compiled kernels at 1 to 16 threads, more threads than this machine has cores: each splits its work into
contiguous ranges of output columns (16-row weight panels for the quantized and int8 kernels, the float32
GEMM's panels) or of rows (the activations' quantizer), never the sum over K, so the product is the same bits
at every thread count, and a thread count past the cores only oversubscribes them."""

import numpy as np
import pytest
import torch
from gguf.quants import quantize

from pagedllm.model.layers import quantized
from pagedllm.model.layers.quantized import Q4_0, Q4_K, Q6_K, Q8_0, QuantizedWeight
from tests.model.test_quant_kernels import random_k_quant

pytestmark = [pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable"),
              pytest.mark.usefixtures("int8_kernels_only")]
THREADS = (1, 2, 3, 8, 16)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def products_at_each_thread_count(fn) -> list[torch.Tensor]:
    outs = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        assert torch.get_num_threads() == threads
        outs.append(fn())
    return outs


@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_K, Q6_K])
@pytest.mark.parametrize("int8", [False, True])
def test_quantized_products_are_the_same_bits_at_every_thread_count(qtype, int8, restore_threads):
    rng = np.random.default_rng(qtype)
    n, k = 200, 512  # 13 panels: uneven ranges at 3, 8 and 16 threads
    if qtype in (Q4_K, Q6_K):
        raw = random_k_quant(qtype, n, k, rng)
    else:
        raw = quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    weight = QuantizedWeight(qtype, torch.from_numpy(raw), k, int8_activations=int8)
    if int8:
        assert weight.use_int8_activations()
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    outs = products_at_each_thread_count(lambda: weight.matmul(x, bias))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_float32_gemm_is_the_same_bits_at_every_thread_count(restore_threads):
    from pagedllm.model.layers import cpu_gemm

    w = torch.randn(200, 384, generator=torch.Generator().manual_seed(3))
    packed = cpu_gemm.pack(w)
    if packed is None:
        pytest.skip("the compiled float32 GEMM is unavailable")
    x = torch.randn(9, 384, generator=torch.Generator().manual_seed(4))
    outs = products_at_each_thread_count(lambda: cpu_gemm.gemm(x, packed, None, 200))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
