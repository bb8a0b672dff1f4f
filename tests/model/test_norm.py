"""RMSNorm against transformers' LlamaRMSNorm, bit for bit in float32 (the fused path) and in bfloat16."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedllm.model.layers import cpu_fused
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
        expected_sum = x + residual
        x_in, residual_in = x.clone(), residual.clone()
        normed, summed = ours(x_in, residual_in)
        assert torch.equal(summed, expected_sum)
        assert torch.equal(normed, hf(expected_sum))
        if dtype == torch.float32 and cpu_fused.usable(x) is not None:
            # written into its inputs (the decoder rebinds both names): a prefill step holds two tensors fewer
            assert normed.data_ptr() == x_in.data_ptr() and summed.data_ptr() == residual_in.data_ptr()
            # a strided input keeps the out-of-place call, its inputs untouched
            wide = torch.cat([x, x], dim=1)
            normed, summed = ours(wide[:, :hidden], residual.clone())
            assert torch.equal(wide[:, :hidden], x) and torch.equal(normed, hf(expected_sum))
