"""Attention overhead of paging: paged_attention vs SDPA on contiguous K/V, same shapes.

Both sides get the same queries, keys and values. The non-paged side holds each sequence's
K/V as one contiguous [num_seqs, num_kv_heads, seq_len, head_dim] tensor and calls torch's
scaled_dot_product_attention (no mask at decode, where every sequence has the same length;
is_causal at prefill). The paged side scatters the same K/V into randomly permuted blocks of a
[2, num_blocks, block_size, num_kv_heads, head_dim] cache and runs the engine's
paged_attention through block tables (which includes gathering the blocks). Outputs are
checked equal; times are medians. Overhead = paged / contiguous - 1 (published: 20-26% for
the paper's CUDA kernel vs FasterTransformer's).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.attention.paged import paged_attention


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(phase: str, num_seqs: int, seq_len: int, num_heads: int = 9, num_kv_heads: int = 3,
            head_dim: int = 64, block_size: int = 16, repeats: int = 10, seed: int = 0) -> dict:
    """One shape: `decode` (1 query per sequence over seq_len keys) or `prefill` (seq_len causal queries)."""
    g = torch.Generator().manual_seed(seed)
    scale = head_dim**-0.5
    num_q = 1 if phase == "decode" else seq_len
    key = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, generator=g)
    value = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, generator=g)
    query = torch.randn(num_seqs, num_heads, num_q, head_dim, generator=g)

    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    block_tables = torch.randperm(num_blocks, generator=g).view(num_seqs, blocks_per_seq)
    pos = torch.arange(seq_len)
    slots = block_tables[:, pos // block_size] * block_size + pos % block_size  # [S, L]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0, slots.reshape(-1)] = key.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    flat[1, slots.reshape(-1)] = value.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    metadata = AttentionMetadata(
        slot_mapping=slots[:, seq_len - num_q:].reshape(-1),
        query_start_loc=torch.arange(num_seqs + 1) * num_q,
        seq_lens=torch.full((num_seqs,), seq_len),
        block_tables=block_tables,
        max_query_len=num_q, max_seq_len=seq_len, block_size=block_size,
    )
    packed_query = query.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [S * q, H, D]

    def contiguous():
        return F.scaled_dot_product_attention(query, key, value, is_causal=phase == "prefill", scale=scale,
                                              enable_gqa=True)

    def paged():
        return paged_attention(packed_query, kv_cache, metadata, scale)

    with torch.inference_mode():
        expected = contiguous().transpose(1, 2).reshape(-1, num_heads, head_dim)
        torch.testing.assert_close(paged(), expected, rtol=1e-4, atol=1e-4)
        t_contiguous = _median_time(contiguous, repeats)
        t_paged = _median_time(paged, repeats)
    return {"phase": phase, "num_seqs": num_seqs, "seq_len": seq_len, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
            "contiguous_ms": 1e3 * t_contiguous, "paged_ms": 1e3 * t_paged, "overhead": t_paged / t_contiguous - 1}


DEFAULT_SHAPES = [("decode", 32, 512), ("decode", 64, 512), ("decode", 128, 256), ("decode", 32, 1024),
                  ("prefill", 1, 512), ("prefill", 4, 256), ("prefill", 8, 128)]


def run_attention(shapes=DEFAULT_SHAPES, repeats: int = 10, progress: bool = True, **model_shape) -> dict:
    from tqdm.auto import tqdm

    rows = [compare(phase, s, l, repeats=repeats, **model_shape)
            for phase, s, l in tqdm(shapes, desc="attention", disable=not progress)]
    return {"rows": rows}


def attention_table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["phase", "seqs", "seq len", "contiguous SDPA ms", "paged ms", "overhead"]
    rows = [[r["phase"], r["num_seqs"], r["seq_len"], r["contiguous_ms"], r["paged_ms"], f"{100 * r['overhead']:+.1f}%"]
            for r in result["rows"]]
    return headers, rows
