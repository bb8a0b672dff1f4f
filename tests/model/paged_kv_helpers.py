"""Test helper: a tiny stand-in for the model runner (block tables, metadata, KV caches)."""

import torch

from pagedllm.model import AttentionMetadata, set_forward_context


def build_metadata(
    block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int], block_size: int
) -> AttentionMetadata:
    """Metadata for seqs whose new tokens are their last ``query_lens`` positions."""
    slots, starts = [], [0]
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + q_len)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


class PagedRunner:
    """Runs steps of several sequences through ``model`` with a paged KV cache.

    Blocks are handed out from a shuffled free list, so block tables are non-contiguous.
    """

    def __init__(self, model, num_blocks: int = 128, block_size: int = 4, seed: int = 0):
        attn = model.model.layers[0].self_attn
        self.model = model
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            for _ in model.model.layers
        ]
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Feed each ``(seq_id, new_token_ids)``; returns logits [num_tokens, vocab]."""
        input_ids, positions, tables, seq_lens, query_lens = [], [], [], [], []
        for seq_id, tokens in chunks:
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            self.lens[seq_id] = end
            input_ids += tokens
            positions += range(start, end)
            tables.append(table)
            seq_lens.append(end)
            query_lens.append(len(tokens))
        metadata = build_metadata(tables, seq_lens, query_lens, self.block_size)
        with torch.no_grad(), set_forward_context(metadata, self.kv_caches):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
            return self.model.compute_logits(hidden)
