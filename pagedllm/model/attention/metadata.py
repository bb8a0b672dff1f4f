"""AttentionMetadata: the per-step description of where each scheduled token's K/V lives.

Tokens of all scheduled sequences are packed seq by seq into one flat batch. Sequence ``i``
owns query tokens ``query_start_loc[i] : query_start_loc[i+1]``; they are its *last*
``query_len`` positions, i.e. positions ``seq_lens[i] - query_len .. seq_lens[i] - 1``::

    seq i context:  [ cached prefix ........ | new tokens (this step) ]
    positions:        0 ... seq_len-query_len-1   seq_len-query_len ... seq_len-1

``slot_mapping[t] = block_id * block_size + offset`` is the flat KV slot token ``t`` writes.
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat KV slot of each scheduled token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int64: context length of each seq after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies of the per-sequence lengths. The model runner passes them (it has them as
    # Python ints anyway); otherwise ``host_lens`` reads them once and keeps them, so a step
    # syncs with the device at most once, not once per layer.
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def host_lens(self) -> tuple[list[int], list[int]]:
        """``(query_lens, seq_lens)`` as Python ints."""
        if self.query_lens_host is None:
            self.query_lens_host = (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()
        if self.seq_lens_host is None:
            self.seq_lens_host = self.seq_lens.tolist()
        return self.query_lens_host, self.seq_lens_host
