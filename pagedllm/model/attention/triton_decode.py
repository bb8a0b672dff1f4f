"""Triton paged attention for decode: one query token per sequence, K/V read through block tables.

One program per (sequence, KV head, split). It handles every query head of its GQA group at
once, so each K/V tile is read from memory once for the whole group (decode is bound by
memory bandwidth, and K/V traffic is all of it)::

    query heads  [kv_head * GROUP, ..., kv_head * GROUP + GROUP - 1]   (padded to BLOCK_G rows)
    key tile     tokens n0 .. n0 + BLOCK_N - 1, each found at
                 cache[block_tables[seq, n // block_size], n % block_size, kv_head]

The tile size is independent of the cache's block size: each token's physical block is looked
up on its own, so any ``block_size`` works and tiles may span several blocks.

Split-K (partitioned) variant for long contexts with few sequences: the sequence's tokens are
cut into ``num_splits`` equal, tile-aligned ranges computed from its *own* length inside the
kernel; each split writes an unnormalized partial output with its running max and sum, and
``_reduce_splits_kernel`` merges them. The grid depends only on (num_seqs, num_kv_heads,
num_splits), never on sequence lengths, so a captured CUDA graph replays with any lengths.
Softmax runs in base 2 (``exp2`` with the scale premultiplied by log2(e)).
"""

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt_seq,
    block_size,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)  # [BLOCK_G, BLOCK_D]

    # A finite start for the running max: a fully masked tile never yields inf - inf.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(block_tables_ptr + seq * stride_bt_seq + n // block_size, mask=n_mask, other=0)
        kv_offs = (block.to(tl.int64) * stride_cache_block + (n % block_size) * stride_cache_tok
                   + kv_head * stride_cache_head)  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial_* are dense: [num_seqs, NUM_HEADS, NUM_SPLITS(, HEAD_DIM)]
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(partial_max_ptr + row, m_i, mask=g_mask)
        tl.store(partial_sum_ptr + row, l_i, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    stride_o_tok, stride_o_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + splits  # [NUM_SPLITS]
    m = tl.load(partial_max_ptr + row)
    l = tl.load(partial_sum_ptr + row)
    acc = tl.load(partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=d_mask[None, :], other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # empty splits: exp2(-1e30 - max) = 0
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                       min_tokens_per_split: int = 256, max_splits: int = 16) -> int:
    """Split only when (seqs x KV heads) leaves SMs idle and each split keeps enough tokens."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    by_length = max(1, max_seq_len // min_tokens_per_split)
    splits = min(wanted, by_length, max_splits)
    return 1 << (splits.bit_length() - 1)  # a power of two at most `splits` (few compiled variants)


def triton_paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    num_splits: int = 1,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of each sequence's one query over its first ``seq_lens[i]`` cached tokens."""
    num_seqs, num_heads, head_dim = query.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, partial_out, partial_max, partial_sum,
        query, k_cache, v_cache, block_tables, seq_lens,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1],
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(kv_cache.dtype),
        num_warps=4,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_max, partial_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_D=block_d,
        )
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """Exact float32 products for a float32 cache (TF32 would lose ~3 digits); tensor-core default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
