"""Turn one step's logits into sampled tokens (and logprobs), one row per sequence.

The sampler knows nothing of scheduling: the model runner describes each row it samples with a
`SamplingRow`, packs them once per step into a `SamplingMetadata` of tensors (metadata.py), and calls
`Sampler`, which composes the steps below: the processors (logits_processors.py), greedy rows by
argmax here, random rows through top_k_top_p_sampler.py, and the logprobs (logprobs.py).

Processing order for every row (vLLM's, which users know):

    raw logits ──► logprobs / ranks reported to the user (log_softmax of the raw logits)
        │
        ├─ logit_bias
        ├─ min_tokens: eos + stop_token_ids to -inf while len(output) < min_tokens
        ├─ penalties: repetition (prompt + output), frequency and presence (output only)
        ├─ structured outputs: tokens the row's grammar forbids to -inf (one bitmask op)
        │
        ├─ greedy rows ─────────────────────────────────────► argmax
        └─ random rows: / temperature ─► top_k ─► top_p ─► min_p ─► inverse-CDF draw

Random rows draw one uniform number each: from their own `torch.Generator` when the request has a
seed, so a seeded request's tokens depend on nothing else in the batch; unseeded rows share one draw
from the default generator. Greedy rows draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.model.sampling.logits_processors import apply_logits_processors
from pagedllm.model.sampling.logprobs import gather_logprobs
from pagedllm.model.sampling.metadata import SamplingMetadata
from pagedllm.model.sampling.top_k_top_p_sampler import random_sample


@dataclass(slots=True)
class SamplerOutput:
    """One step's sampled tokens, and logprobs when some row asked for them."""

    sampled_token_ids: torch.Tensor
    """[N] int64."""
    logprob_token_ids: torch.Tensor | None
    """[N, 1 + max_num_logprobs] int64: column 0 the sampled token, then the top ids (most likely first)."""
    logprobs: torch.Tensor | None
    """[N, 1 + max_num_logprobs] float32, the raw model logprobs of logprob_token_ids."""
    sampled_token_ranks: torch.Tensor | None
    """[N] int64: rank of the sampled token in the raw distribution (1 = most likely)."""


class Sampler(nn.Module):
    """Logits [N, V] + SamplingMetadata -> SamplerOutput. Stateless."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_rows
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)

        if metadata.all_greedy and not metadata.has_logits_processors:
            # Nothing rewrites the logits: argmax reads them as they are (a copy of [N, V] float32
            # cost about as much as the argmax itself at 16-64 rows).
            sampled = argmax_rows(logits)
        else:
            sampled = self._process_and_sample(logits, metadata)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    @staticmethod
    def _process_and_sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        x = logits.to(torch.float32, copy=True)  # processed in place from here on
        if metadata.has_logits_processors:
            x = apply_logits_processors(x, metadata)

        if metadata.all_greedy:
            sampled = argmax_rows(x)
        else:
            greedy_ids = argmax_rows(x) if metadata.greedy_mask is not None else None
            sampled = random_sample(x, metadata)
            if greedy_ids is not None:
                sampled = torch.where(metadata.greedy_mask, greedy_ids, sampled)
        return sampled


_ARGMAX_CHUNK = 128
_ARGMAX_PIECE = 16384
"""Floats per amax call below _ARGMAX_SERIAL_MAX: under ATen's parallel grain, so each runs on the caller."""
_ARGMAX_SERIAL_MAX = 1 << 17
"""Logits (rows x vocab) up to which argmax_rows stays on the calling thread (1-2 rows of 49152)."""


def _argmax_op():
    """The compiled ``argmax_rows_cpu``'s C++ callable, or None where the library is not loaded."""
    if "op" not in _ARGMAX_OP:
        from pagedllm.model.attention import cpu_op

        overload = getattr(torch.ops.pagedllm, "argmax_rows_cpu", None) if cpu_op.load() else None
        _ARGMAX_OP["op"] = None if overload is None else getattr(overload.default, "_op", overload.default)
    return _ARGMAX_OP["op"]


_ARGMAX_OP: dict[str, object] = {}


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of [N, V] logits, the same indices (first occurrence of the maximum; a
    NaN counts as the maximum, as in argmax).

    On a CPU float32 batch with the compiled library: one call of ``argmax_rows_cpu`` (vectorized
    max, then the first index equal to it; ~10 ATen calls less a step at batch 1). Otherwise:

    On the CPU, argmax over a row is scalar code (~2.6 ns an element: 8 ms for 64 x 49152 logits,
    1 thread) while amax is vectorized; so take the maximum of each 128-wide chunk, the first chunk
    holding the row's maximum (argmax over V/128 values), then the first maximum inside that chunk:
    6-9x faster at 16-64 rows. Other devices, and vocabularies not a multiple of the chunk, use argmax.
    """
    num_rows, vocab = x.shape
    if x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and vocab and _argmax_op() is not None:
        return _ARGMAX_OP["op"](x)  # one compiled call (csrc/step_ops.cpp): the same indices, no ATen calls
    if x.device.type != "cpu" or vocab % _ARGMAX_CHUNK or not x.is_contiguous() or not x.is_floating_point():
        return x.argmax(dim=-1)
    num_chunks = vocab // _ARGMAX_CHUNK
    flat = x.view(num_rows * num_chunks, _ARGMAX_CHUNK)
    if num_rows * vocab <= _ARGMAX_SERIAL_MAX:
        # In pieces of _ARGMAX_PIECE floats, each under ATen's grain (32768), so no OpenMP region
        # opens: at batch 1 the engine's passive OpenMP workers cost more to wake than the whole
        # amax (one row of 49152: 13.6 ms -> 0.26 ms per call, 2 threads on a contended 2-core
        # machine, /tmp microbenchmark; ~0.1 ms -> ~0.03 ms idle).
        step = _ARGMAX_PIECE // _ARGMAX_CHUNK
        maxes = torch.cat([flat[i : i + step].amax(dim=-1) for i in range(0, flat.shape[0], step)])
    else:
        maxes = flat.amax(dim=-1)
    chunk = maxes.view(num_rows, num_chunks).argmax(dim=-1)  # [N]: NaN propagates through amax, argmax picks it
    # index_select, not advanced indexing: the same rows without aten::index's overhead
    within = flat.index_select(0, chunk + torch.arange(0, num_rows * num_chunks, num_chunks)).argmax(dim=-1)
    return chunk * _ARGMAX_CHUNK + within
