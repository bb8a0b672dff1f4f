"""Triton paged attention for prefill and chunked prefill: variable-length queries over paged K/V.

Queries of all sequences are packed (``query_start_loc``); a sequence's queries are its last
``query_len`` positions, so a chunk of a long prompt attends to the cached prefix written by
earlier steps and, causally, to itself (its own K/V are written before this kernel runs)::

    seq context:   [ cached prefix ............ | this step's queries ]
    positions:       0 .. seq_len-query_len-1     seq_len-query_len .. seq_len-1
    query row r (position p = seq_len - query_len + r) sees keys 0 .. p

One program per (query tile of BLOCK_M rows, sequence, query head); it streams K/V tiles of
BLOCK_N tokens through the block table with an online softmax (FlashAttention-style), and stops
at the last key its last row can see. Decode rows (query_len 1) in a mixed batch are just
sequences with one row.
"""

import torch
import triton
import triton.language as tl

from pagedllm.model.attention.triton_decode import _LOG2E, dot_precision


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt_seq,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    q_pos = prefix_len + rows  # [BLOCK_M] absolute positions
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_offs = (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_D]

    # Keys this tile can see end at its last valid row's position; 0 when the tile is past the end.
    num_keys = tl.where(m_block * BLOCK_M < query_len,
                        tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, num_keys, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < num_keys
        block = tl.load(block_tables_ptr + seq * stride_bt_seq + n // block_size, mask=n_mask, other=0)
        kv_offs = (block.to(tl.int64) * stride_cache_block + (n % block_size) * stride_cache_tok
                   + kv_head * stride_cache_head)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def triton_paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    max_query_len: int,
    scale: float,
    block_m: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of packed variable-length queries over their sequences' paged K/V."""
    num_tokens, num_heads, head_dim = query.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    if block_d > 128:  # keep the tiles within shared memory
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1],
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(kv_cache.dtype),
        num_warps=4, num_stages=2,
    )
    return out
