"""paged_attention against a naive dense causal attention, one sequence at a time."""

import math

import pytest
import torch

from pagedllm.model.attention.paged import causal_attention_no_cache, paged_attention, write_kv_cache
from tests.model.paged_kv_helpers import build_metadata


def naive_attention(q, k, v, first_pos, scale):
    """q [Q, H, D] at positions first_pos.., k/v [L, Hkv, D] -> [Q, H, D], float64 for reference."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(q.shape[0])[:, None] + first_pos
    k_pos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def run_case(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s in seq_lens:
        tables.append([perm.pop() for _ in range(math.ceil(s / block_size))])
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)  # garbage
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    queries = [torch.randn(q, num_heads, head_dim, generator=gen) for q in query_lens]
    scale = head_dim**-0.5

    # The cached prefix was written in earlier steps; this step writes the new tokens' K/V.
    prefix = build_metadata(tables, seq_lens, seq_lens, block_size)
    starts = prefix.query_start_loc
    all_k, all_v = torch.cat(keys), torch.cat(values)
    old = torch.cat(
        [torch.arange(starts[i], starts[i + 1] - q) for i, q in enumerate(query_lens)]
    ).long()
    write_kv_cache(all_k[old], all_v[old], kv_cache, prefix.slot_mapping[old])

    metadata = build_metadata(tables, seq_lens, query_lens, block_size)
    new_k = torch.cat([k[s - q :] for k, s, q in zip(keys, seq_lens, query_lens)])
    new_v = torch.cat([v[s - q :] for v, s, q in zip(values, seq_lens, query_lens)])
    write_kv_cache(new_k, new_v, kv_cache, metadata.slot_mapping)
    out = paged_attention(torch.cat(queries), kv_cache, metadata, scale)

    expected = torch.cat(
        [naive_attention(qs, k, v, s - q, scale) for qs, k, v, s, q in zip(queries, keys, values, seq_lens, query_lens)]
    )
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [
        ([7], [7]),  # prefill ending mid-block
        ([8, 5, 13], [8, 5, 13]),  # several prefills, block-aligned and not
        ([9, 1, 17], [1, 1, 1]),  # decode-only, including a 1-token sequence
        ([20], [6]),  # chunked prefill over a cached prefix
        ([11, 3, 25, 6], [1, 3, 4, 1]),  # mixed: decode, prefill, chunk, decode
    ],
)
def test_paged_matches_naive(seq_lens, query_lens):
    run_case(seq_lens, query_lens)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_gqa_ratios(num_heads, num_kv_heads):
    run_case([10, 4], [3, 4], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=1)


def test_block_size_16_and_padding_in_block_tables():
    run_case([40, 2, 17], [5, 2, 1], block_size=16, seed=2)


def test_write_kv_cache_places_slots():
    kv_cache = torch.zeros(2, 3, 4, 1, 2)
    key = torch.arange(4.0).reshape(2, 1, 2)
    write_kv_cache(key, -key, kv_cache, torch.tensor([5, 11]))
    assert torch.equal(kv_cache[0, 1, 1, 0], key[0, 0])  # slot 5 = block 1, offset 1
    assert torch.equal(kv_cache[1, 2, 3, 0], -key[1, 0])  # slot 11 = block 2, offset 3
    assert kv_cache.abs().sum() == 2 * key.abs().sum()


def test_no_cache_attention_is_block_diagonal_causal():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(7, 4, 8, generator=gen)
    k = torch.randn(7, 2, 8, generator=gen)
    v = torch.randn(7, 2, 8, generator=gen)
    out = causal_attention_no_cache(q, k, v, 0.3, torch.tensor([0, 3, 7]))
    expected = torch.cat([naive_attention(q[:3], k[:3], v[:3], 0, 0.3), naive_attention(q[3:], k[3:], v[3:], 0, 0.3)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
