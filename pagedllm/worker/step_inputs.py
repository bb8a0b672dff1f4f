"""A step's inputs: each running request's state as the runner keeps it (updated from the scheduler's diffs),
and the flat token ids, positions and attention metadata built from it for the tokens a step schedules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedllm.lora.request import LoRARequest
from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.sampling.metadata import RequestTensors
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class RunnerRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int]
    fork_children: list[tuple[str, SamplingParams]]
    """Parallel samples drawn from this request's first sampling logits (then forked by the scheduler)."""
    tensors: RequestTensors | None = None
    """logit_bias and min_tokens ids as tensors, shared with the request's other sequences (None: built
    per step, for states made outside the runner)."""
    lora_request: LoRARequest | None = None
    """The adapter this request generates with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling request: pooled when its prompt is computed, never sampled."""


class InputRow(Protocol):
    """What input preparation reads of a request (RunnerRequestState, or a draft proposer's row)."""

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
