"""16-bit KV caches (``--kv-cache-dtype float16 | bfloat16``) in the compiled CPU op and the torch
reference: compute stays float32, K/V are rounded on write and widened on read.

Two comparisons per case: the op against the reference on the *same* 16-bit cache (both widen
the same stored values, so they agree to float32 rounding), and either against float32 attention
over the unrounded K/V (the storage loss: bounded by the 16-bit formats' relative precision).
"""

import pytest
import torch

from pagedllm.model.attention import cpu_op
from pagedllm.model.attention.backend import CpuAttentionBackend, TORCH_BACKEND
from pagedllm.model.attention.paged import paged_attention, write_kv_cache
from tests.model.test_cpu_attention import BOTH, PATHS, available_isas, compiled_op, random_case  # noqa: F401

KV_DTYPES = (torch.float16, torch.bfloat16)
# Attention output vs float32 K/V: |K/V| ~ 1 rounded to 11 (float16) or 8 (bfloat16) significant
# bits, averaged by the softmax; the loss is far below these bounds yet far above 1e-5.
STORAGE_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def check16(seq_lens, query_lens, kv_dtype, paths=("default",), num_splits=0, **kw):
    query, kv32, metadata, scale = random_case(seq_lens, query_lens, **kw)
    kv16 = kv32.to(kv_dtype)
    expected = paged_attention(query, kv16, metadata, scale)
    assert expected.dtype == torch.float32
    exact32 = paged_attention(query, kv32, metadata, scale)
    tol = STORAGE_TOL[kv_dtype]
    torch.testing.assert_close(expected, exact32, atol=tol, rtol=tol)
    for isa in available_isas():
        for path in paths:
            out = cpu_op.paged_attention_cpu(query, kv16, metadata, scale, num_splits=num_splits, isa=isa,
                                             tile_min_rows=PATHS[path])
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{kv_dtype}, isa {isa}, {path} path: {m}")
            assert (out - exact32).abs().max() > 0, "a 16-bit cache cannot be exact: was it read as float32?"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode(kv_dtype, block_size, head_dim):
    check16([1, 17, 33, 100, 250], [1] * 5, kv_dtype, paths=BOTH, block_size=block_size, head_dim=head_dim)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_chunked_prefill_and_mixed(kv_dtype, block_size):
    # A long chunk after a prefix (tiled path), a whole prompt, a short chunk, decode rows.
    check16([737, 129, 50, 90, 33], [300, 129, 7, 1, 1], kv_dtype, paths=BOTH, block_size=block_size, seed=3)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (9, 3), (8, 1), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_mqa_mha(kv_dtype, num_heads, num_kv_heads, head_dim):
    check16([200, 150, 40], [120, 1, 1], kv_dtype, paths=BOTH, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, seed=4)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_shared_blocks_splits_and_other_head_dims(kv_dtype):
    check16([170, 190, 96], [60, 190, 1], kv_dtype, shared_prefix_blocks=4, seed=5)
    check16([900], [1], kv_dtype, num_splits=4, seed=6)  # one long context split over its keys
    check16([900], [200], kv_dtype, num_splits=3, paths=("tiled",), seed=7)
    for head_dim in (32, 80, 96, 256):
        check16([140, 70], [100, 1], kv_dtype, paths=BOTH, head_dim=head_dim, num_heads=4, num_kv_heads=2,
                seed=head_dim)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_kv_write_rounds_like_tensor_to(kv_dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    kv_cache = torch.randn(2, 40, 16, 3, 64, generator=gen).to(kv_dtype)
    qkv = torch.randn(num_tokens, (9 + 2 * 3) * 64, generator=gen) * 3
    # Values exactly halfway between two 16-bit neighbours (ties go to the even one), subnormals,
    # overflow and specials, which a truncating or round-half-up store gets wrong.
    specials = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65520.0, 1e5, 3e-6, -7e-8,
                             float("inf"), float("-inf"), 0.0, -0.0])
    qkv[0, 576:576 + len(specials)] = specials
    key, value = qkv[:, 576:768].view(num_tokens, 3, 64), qkv[:, 768:].view(num_tokens, 3, 64)
    slots = torch.randperm(40 * 16, generator=gen)[:num_tokens]
    expected = kv_cache.clone()
    flat = expected.view(2, -1, 3, 64)
    flat[0][slots] = key.to(kv_dtype)
    flat[1][slots] = value.to(kv_dtype)
    assert cpu_op.supports_kv_write(key, value, kv_cache)
    CpuAttentionBackend().write_kv_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache.view(torch.int16), expected.view(torch.int16))  # bit for bit
    reference = kv_cache.clone()
    write_kv_cache(key, value, reference, slots)  # the torch path stores the same bits
    assert torch.equal(reference.view(torch.int16), kv_cache.view(torch.int16))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_backends_agree_end_to_end_on_a_16_bit_cache(kv_dtype):
    # Write a step's K/V through each backend into its own 16-bit cache, then attend.
    query, kv32, metadata, scale = random_case([60, 33, 20], [12, 1, 20], seed=9)
    num_tokens = query.shape[0]
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, num_tokens, 3, 64, generator=gen)
    outs = []
    for backend in (TORCH_BACKEND, CpuAttentionBackend()):
        cache = kv32.to(kv_dtype)
        backend.write_kv_cache(key, value, cache, metadata.slot_mapping)
        outs.append(backend.forward(query, cache, metadata, scale))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
