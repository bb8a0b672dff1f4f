"""Pooling requests in the runner: each prompt's final hidden states, kept across its chunks, pooled
by the model's head (model/layers/pooler.py) when its last chunk has run.

A prompt computed in chunks (chunked prefill) or resumed after preemption arrives as pieces, each
starting at its `num_computed_tokens`. A piece starting at or before a kept one replaces it (a
preempted request recomputes from there), so the rows pooled are exactly positions 0 .. n-1 once.
Last-token pooling keeps nothing: only the last chunk's last row is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.model.layers.pooler import Pooler


class PoolingRunner:
    """The runner's pooling: the head, and the rows of prompts still being computed."""

    def __init__(self, pooler: Pooler) -> None:
        self.pooler = pooler
        self._pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        """req_id -> (first position, [rows, hidden]) of each chunk computed so far, in position order."""

    def drop(self, req_id: str) -> None:
        """Forget a finished or aborted request's kept rows."""
        self._pieces.pop(req_id, None)

    @property
    def num_kept_requests(self) -> int:
        return len(self._pieces)

    def execute_encoder(self, model, states: Sequence, num_scheduled: list[int],
                        device: torch.device) -> ModelRunnerOutput:
        """An encoder's step. Every token attends to every other, so a sequence runs whole, in the step
        that schedules its last tokens (earlier chunks only take their share of the step's budget); each
        is pooled at once. Nothing is kept between steps."""
        output = ModelRunnerOutput(sampled_token_ids={})
        complete = [s for s, n in zip(states, num_scheduled) if s.num_computed_tokens + n == len(s.token_ids)]
        if not complete:
            return output
        seq_lens = [len(s.token_ids) for s in complete]
        input_ids = torch.tensor([t for s in complete for t in s.token_ids], dtype=torch.int64, device=device)
        token_types = torch.tensor([t for s in complete for t in (s.pooling_params.token_type_ids or
                                                                  [0] * len(s.token_ids))],
                                   dtype=torch.int64, device=device)
        hidden_states = model(input_ids, token_types, seq_lens)  # [num_tokens, hidden]
        for state, rows in zip(complete, hidden_states.split(seq_lens)):
            output.pooled[state.req_id] = self.pooler(rows, state.pooling_params.dimensions).tolist()
        return output

    def collect(self, states: Sequence, num_scheduled: list[int], hidden_states: torch.Tensor,
                pooled: dict[str, list[float]], failed: dict[str, str]) -> None:
        """Keep this step's rows of each pooling request; pool those whose prompt is now complete."""
        starts = [0, *accumulate(num_scheduled)]
        for i, (state, n) in enumerate(zip(states, num_scheduled)):
            params = state.pooling_params
            if params is None:
                continue
            first = state.num_computed_tokens
            rows = hidden_states[starts[i] : starts[i] + n]  # [n, hidden]
            complete = first + n == len(state.token_ids)
            if not params.needs_every_position:
                if complete:
                    pooled[state.req_id] = self.pooler(rows[-1:], params.dimensions).tolist()
                continue
            pieces = [p for p in self._pieces.pop(state.req_id, []) if p[0] < first]
            pieces.append((first, rows.clone()))  # a copy: the step's output buffer may be reused
            if not complete:
                self._pieces[state.req_id] = pieces
                continue
            hidden = torch.cat([p[1] for p in pieces])
            expected_starts = [0, *accumulate(len(p[1]) for p in pieces[:-1])]
            if [p[0] for p in pieces] != expected_starts or hidden.shape[0] != len(state.token_ids):
                failed[state.req_id] = (f"pooling: the prompt's hidden states arrived as pieces starting at "
                                        f"{[p[0] for p in pieces]}, not covering its {len(state.token_ids)} positions")
                continue
            pooled[state.req_id] = self.pooler(hidden, params.dimensions).tolist()
