"""CPU PyTorch reference of paged attention: write K/V into blocks, attend through block tables.

KV cache layout, one tensor per layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]     (0 = K, 1 = V)
    flat slot s = block_id * block_size + offset  ->  kv_cache[:, s // block_size, s % block_size]

``paged_attention`` handles prefill, chunked prefill over a cached prefix, decode and mixed
batches without padding one sequence's queries to another's length: all decode rows (one query
each) are batched through the block tables with each KV head's query group folded; every longer
query (a prompt or a chunk of one) runs its own causal SDPA over its own gathered K/V. A decode-
only step makes no host sync; a mixed step reads the query lengths once (``host_lens``).

The cache may hold a narrower dtype than the model computes in (``--kv-cache-dtype``): writes
round K/V to it (``Tensor.to``, round to nearest even), reads widen the gathered K/V back to the
query's dtype, so attention itself runs in the compute dtype.
"""

import torch
import torch.nn.functional as F

from pagedllm.model.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each token's K and V at its flat slot (in place)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _gather_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's K and V in ``dtype``, padded: two [num_seqs, num_kv_heads, max_seq_len, head_dim]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks_needed = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks_needed]  # [num_seqs, nb]
    num_seqs = tables.shape[0]
    # index_select over rows of a 2-D view is far faster on CPU (measured ~100x on 2 threads)
    # than index_select or advanced indexing over the 4-D block tensor.
    blocks = kv_cache.reshape(2, num_blocks, -1)
    key = blocks[0].index_select(0, tables.reshape(-1)).to(dtype)  # [S * nb, block_size * Hkv * D]
    value = blocks[1].index_select(0, tables.reshape(-1)).to(dtype)
    key = key.view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_seq_len]  # [S, L, Hkv, D]
    value = value.view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_seq_len]
    return key.transpose(1, 2), value.transpose(1, 2)  # [S, Hkv, L, D]


def _attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """SDPA over [..., H, Q, D] queries and [..., Hkv, L, D] keys/values (query head h reads KV head
    h // (H / Hkv)); ``mask`` True = visible. With ``softcap`` the scores are capped first, spelled
    out as HF's eager attention computes them."""
    gqa = key.shape[-3] != q.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        repeat = q.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [..., H, Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(value.dtype), value)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Each sequence's last token attends to its whole cached context.

    Each KV head's group of query heads is folded into the query axis, so SDPA reads each K/V
    head once instead of expanding it per query head (query head h uses KV head h // group, as
    in HF's repeat_kv).
    """
    num_seqs, num_heads, head_dim = query.shape
    key, value = _gather_kv(kv_cache, block_tables, max_seq_len, query.dtype)  # [S, Hkv, L, D]
    num_kv_heads = key.shape[1]
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [S, Hkv, G, D]
    key_pos = torch.arange(max_seq_len, device=query.device)
    mask = key_pos < seq_lens[:, None]  # [S, L]
    if sliding_window is not None:  # the query sits at seq_len - 1
        mask &= key_pos >= seq_lens[:, None] - sliding_window
    out = _attend(q, key, value, mask[:, None, None, :], scale, softcap)  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]: one sequence's last query_len positions
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_num_blocks] this sequence's blocks
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal attention of one sequence's new tokens over its cached prefix and themselves.

    Query row r sits at position ``p = seq_len - query_len + r`` and sees keys ``0 .. p`` (with a
    window W: ``p - W + 1 .. p``).
    """
    query_len, num_heads, _ = query.shape
    key, value = _gather_kv(kv_cache, block_table[None], seq_len, query.dtype)  # [1, Hkv, L, D]
    q = query.transpose(0, 1)[None]  # [1, H, Q, D]
    if query_len == seq_len and (sliding_window is None or sliding_window >= seq_len):
        # no cached prefix and no key out of the window: SDPA's own (top-left) causal mask is ours
        out = _attend(q, key, value, None, scale, softcap, is_causal=True)
    else:
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = key_pos <= q_pos  # [Q, L]
        if sliding_window is not None:
            mask &= key_pos > q_pos - sliding_window
        out = _attend(q, key, value, mask, scale, softcap)
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of every scheduled token over its sequence's cached history.

    The K/V of this step's tokens must already be written (``write_kv_cache``). Nothing is
    padded across sequences: decode rows (query_len 1) go through one batched decode call, and
    each longer query through its own causal SDPA over its own K/V, so a step pays only for its
    own tokens.
    """
    opts = dict(sliding_window=sliding_window, softcap=softcap)
    if metadata.max_query_len == 1:  # decode only: no host sync needed
        return paged_decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                      metadata.max_seq_len, scale, **opts)
    query_lens, seq_lens = metadata.host_lens()
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    if len(decodes) == len(query_lens):
        return paged_decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                      metadata.max_seq_len, scale, **opts)
    out = torch.empty_like(query)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        seqs = torch.tensor(decodes, device=query.device)
        out[rows] = paged_decode_attention(
            query[rows], kv_cache, metadata.block_tables[seqs], metadata.seq_lens[seqs],
            max(seq_lens[i] for i in decodes), scale, **opts,
        )
    for i, q in enumerate(query_lens):
        if q > 1:
            out[starts[i] : starts[i] + q] = paged_prefill_attention(
                query[starts[i] : starts[i] + q], kv_cache, metadata.block_tables[i], seq_lens[i], scale, **opts
            )
    return out


def causal_attention_no_cache(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    scale: float,
    query_start_loc: torch.Tensor | None = None,  # [num_seqs + 1]; None = one sequence
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention over the current tokens only (profiling / dummy runs without a cache).

    With ``query_start_loc`` each packed sequence attends only to itself (block-diagonal).
    """
    num_tokens = query.shape[0]
    pos = torch.arange(num_tokens, device=query.device)
    mask = pos[None, :] <= pos[:, None]  # [T, T]
    if sliding_window is not None:  # positions within one packed sequence differ as their rows do
        mask &= pos[None, :] > pos[:, None] - sliding_window
    if query_start_loc is not None:
        num_seqs = query_start_loc.shape[0] - 1
        lens = query_start_loc[1:] - query_start_loc[:-1]
        seq = torch.repeat_interleave(
            torch.arange(num_seqs, device=query.device), lens, output_size=num_tokens
        )
        mask = mask & (seq[None, :] == seq[:, None])
    out = _attend(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), mask, scale,
                  softcap)  # [H, T, D]
    return out.transpose(0, 1)
