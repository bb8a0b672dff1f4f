"""RMSNorm against transformers' LlamaRMSNorm, bit for bit in float32 (the fused path) and in bfloat16."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedllm.model.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 300])
def test_rms_norm_equals_hf_exactly(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = 576
    weight = torch.randn(hidden, generator=gen) + 1.0
    ours, hf = RMSNorm(hidden, 1e-5), LlamaRMSNorm(hidden, 1e-5)
    ours.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = (torch.randn(num_tokens, hidden, generator=gen) * 4).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, hf(x + residual))
