"""Per-request sampling tensors (logit_bias, min_tokens ids) built once per user request, not per sequence."""

from __future__ import annotations

import torch

from pagedllm.model.sampling.metadata import RequestTensors
from pagedllm.sampling_params import SamplingParams


class RequestTensorCache:
    """RequestTensors built once per user request and shared by all of its sequences.

    The sequences of an n > 1 request carry shallow copies of one SamplingParams (same logit_bias
    dict, same stop_token_ids list), so those objects identify the request. Each entry keeps the
    params it was built from (their ids cannot be reused while it lives) and counts its users.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._entries: dict[tuple, list] = {}  # key -> [params, tensors, users]
        self.num_builds = 0

    @staticmethod
    def _key(params: SamplingParams, eos_token_ids: list[int]) -> tuple:
        return id(params.logit_bias), id(params.stop_token_ids), params.min_tokens > 0, tuple(eos_token_ids)

    def acquire(self, params: SamplingParams, eos_token_ids: list[int]) -> RequestTensors:
        entry = self._entries.get(self._key(params, eos_token_ids))
        if entry is None:
            self.num_builds += 1
            tensors = RequestTensors.build(params, eos_token_ids, self.vocab_size, self.device)
            entry = self._entries[self._key(params, eos_token_ids)] = [params, tensors, 0]
        entry[2] += 1
        return entry[1]

    def peek(self, params: SamplingParams, eos_token_ids: list[int]) -> RequestTensors | None:
        entry = self._entries.get(self._key(params, eos_token_ids))
        return entry[1] if entry is not None else None

    def release(self, params: SamplingParams, eos_token_ids: list[int]) -> None:
        key = self._key(params, eos_token_ids)
        entry = self._entries[key]
        entry[2] -= 1
        if entry[2] == 0:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
