"""A step's forward context: what the layers read besides the token ids, and how the runner makes it.

``build_step_inputs`` turns the rows a step computes (each row's known token ids, computed count and block
table) into the flat token ids, positions and ``AttentionMetadata``. The model runner then wraps each forward
pass in ``with set_forward_context(metadata, kv_caches):``, the one explicit channel through which the attention
layers (and the fused decoder) see the metadata and KV caches: every ``Attention`` layer reads
``get_forward_context()`` instead of threading metadata through each ``forward`` signature. A step with LoRA
adapters also sets its rows' segments (``set_lora_segments``, which ``pagedllm/lora``'s ``lora_step`` calls): the
layers read them here, so model/ needs nothing from lora/. Rows, not requests: model/ knows none.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedllm.model.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]; None = no cache.
    kv_caches: list[torch.Tensor] | None


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor] | None
) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` and ``kv_caches`` visible to attention layers for this block."""
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata, kv_caches)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext | None:
    """The context set by the innermost ``set_forward_context``, or None outside of one."""
    return _current


_lora_segments: list[int] = []


@contextmanager
def set_lora_segments(segments: list[int]) -> Iterator[None]:
    """Make ``segments`` (``[begin, end, slot, ...]`` over the step's rows) the rows whose linears add an adapter's
    delta during this block; [] = none."""
    global _lora_segments
    previous, _lora_segments = _lora_segments, segments
    try:
        yield
    finally:
        _lora_segments = previous


def get_lora_segments() -> list[int]:
    """The segments of the step in progress ([] outside ``set_lora_segments`` or for a step without adapters)."""
    return _lora_segments


class InputRow(Protocol):
    """What input preparation reads of a row (the runner's state of a request, or a draft proposer's row)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]


def build_step_inputs(states: Sequence[InputRow], num_scheduled: list[int], block_size: int,
                      device: torch.device):
    """Flat token ids, positions and attention metadata for `num_scheduled[i]` tokens of states[i]
    from its num_computed_tokens, built with tensor ops; the draft proposer reads its inputs here too.

        query_start_loc: [0, n0, n0+n1, ...]      tokens of request i: qsl[i]:qsl[i+1]
        position of token t of request i = num_computed[i] + (t - qsl[i])
        slot of a position p = block_table[i][p // block_size] * block_size + p % block_size
    """
    bs = block_size
    max_blocks = max(len(s.block_ids) for s in states)
    # One array from padded lists (a tensor and a copy per request cost ~0.5 ms a step at 64 requests),
    # built by numpy: torch.tensor reads nested lists ~3x slower (~250 vs ~90 us at 64 x 45 blocks).
    block_tables = torch.from_numpy(
        np.array([s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in states], dtype=np.int64))
    if max(num_scheduled) == 1:
        # Decode only (most steps of a trace): one token per request, read off in Python; the
        # tensor path below costs ~10 small ops (repeat_interleave, gathers) for the same result.
        position_list = [s.num_computed_tokens for s in states]
        input_id_list = [s.token_ids[p] for s, p in zip(states, position_list)]
        seq_lens_host = [p + 1 for p in position_list]
        slot_list = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(states, position_list)]
        # One host array holding the step's five vectors: one conversion, one split (torch.arange for
        # query_start_loc alone cost as much as the rest)
        n = len(states)
        input_ids, positions, slot_mapping, seq_lens, query_start_loc = torch.from_numpy(
            np.array(input_id_list + position_list + slot_list + seq_lens_host + list(range(n + 1)),
                     dtype=np.int64)).split((n, n, n, n, n + 1))
    else:
        input_id_list = []
        for state, n in zip(states, num_scheduled):
            input_id_list.extend(state.token_ids[state.num_computed_tokens : state.num_computed_tokens + n])
        num_tokens = torch.tensor(num_scheduled, dtype=torch.int64)
        num_computed = torch.tensor([s.num_computed_tokens for s in states], dtype=torch.int64)
        query_start_loc = torch.zeros(len(states) + 1, dtype=torch.int64)
        torch.cumsum(num_tokens, 0, out=query_start_loc[1:])
        req_index = torch.repeat_interleave(torch.arange(len(states)), num_tokens,
                                            output_size=len(input_id_list))
        positions = torch.arange(len(input_id_list)) - query_start_loc[req_index] + num_computed[req_index]
        slot_mapping = block_tables[req_index, positions // bs] * bs + positions % bs
        seq_lens = num_computed + num_tokens
        seq_lens_host = seq_lens.tolist()
        input_ids = torch.tensor(input_id_list, dtype=torch.int64)
    if device.type != "cpu":  # on the CPU the tensors are used as built: no seven .to calls a step
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables = (
            t.to(device) for t in (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables))
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=max(num_scheduled),
        max_seq_len=max(seq_lens_host),
        block_size=bs,
        query_lens_host=list(num_scheduled),
        seq_lens_host=seq_lens_host,
    )
    return input_ids, positions, metadata
