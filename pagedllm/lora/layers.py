"""Adapter weights inside the model: fixed slots on each patched linear, and the step's rows by slot.

A patched linear (qkv_proj, o_proj, gate_up_proj, down_proj) holds every slot's A and B in two matrices,
slot s owning columns (rows of b) ``[s*W, (s+1)*W)``, ``W = n_parts * max_rank``; inside its block the fused
parts (q, k, v; gate, up) sit side by side, B block-diagonal so one product pair covers the fused output::

    a  [in, L*W]    columns s*W + p*r .. s*W + p*r + r     = A^T of part p of slot s's adapter (rank r)
    b  [L*W, out]   those rows, columns of part p           = (B of part p * scaling)^T; all else zero
    ranks [L]       r of each slot's adapter on this linear (0: none)

The runner puts each adapter's rows side by side (base rows first), so a step's adapted rows are a few
segments ``(begin, end, slot)`` (``LoRAStep``). ``LoRASlots.apply`` adds their deltas in one call of the
compiled ``lora_sgmv_cpu`` (csrc/lora_sgmv*.cpp), which shrinks each segment by its own slot's
``n_parts * r`` columns of ``a`` and expands by its own rows of ``b``, part by part: the arithmetic of the
adapters present. The fused decoder step (csrc/decoder_layer.cpp) calls the same op on the same
arguments, so LoRA steps stay on it with the same sums. Without the compiled op (another device or
dtype) each segment runs as a torch product pair.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class LoRAStep:
    """One step's adapted rows: ``segments`` is ``[begin, end, slot, begin, end, slot, ...]`` over the rows
    of the batch (rows in no segment are the base model's)."""

    def __init__(self, segments: list[int]) -> None:
        self.segments = segments


_step: LoRAStep | None = None


@contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    """Make `step` the rows every patched linear adapts during this block (the forward pass); None: none."""
    global _step
    previous, _step = _step, step
    try:
        yield
    finally:
        _step = previous


def current_segments() -> list[int]:
    """The segments of the step in progress ([] outside ``lora_step`` or for a step without adapters)."""
    return [] if _step is None else _step.segments


def compiled_op():
    """The C++ callable of ``lora_sgmv_cpu``, or None where the compiled library or a kernel for this CPU
    is missing."""
    from pagedllm.model.attention import cpu_op

    if not cpu_op.load() or not hasattr(torch.ops.pagedllm, "lora_sgmv_cpu"):
        return None
    if torch.ops.pagedllm.lora_sgmv_isa(0) == 0:
        return None
    overload = torch.ops.pagedllm.lora_sgmv_cpu.default
    return getattr(overload, "_op", overload)


class LoRASlots:
    """The adapter slots of one linear whose output is the concatenation of parts of `part_sizes` features."""

    def __init__(self, in_features: int, part_sizes: Sequence[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        self.width = len(self.part_sizes) * max_rank
        self.a = torch.zeros(in_features, max_loras * self.width, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras * self.width, sum(self.part_sizes), dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)  # updated in place: the fused step holds it
        self._op = compiled_op() if self.a.is_cpu and dtype == torch.float32 else None

    @property
    def compiled(self) -> bool:
        """Whether ``apply`` runs the compiled op (the fused decoder step can take these slots)."""
        return self._op is not None

    def set_slot(self, slot: int, rank: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Hold one adapter in `slot`: parts[p] is (A [rank, in], scaled B [out_p, rank]) of part p, or None."""
        self.clear_slot(slot)
        for p, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            cols = slice(slot * self.width + p * rank, slot * self.width + (p + 1) * rank)
            outs = slice(self.part_offsets[p], self.part_offsets[p] + self.part_sizes[p])
            assert a.shape == (rank, self.a.shape[0]) and b.shape == (self.part_sizes[p], rank), (a.shape, b.shape)
            self.a[:, cols] = a.t()
            self.b[cols, outs] = b.t()
        self.ranks[slot] = rank

    def clear_slot(self, slot: int) -> None:
        block = slice(slot * self.width, (slot + 1) * self.width)
        self.a[:, block] = 0
        self.b[block] = 0
        self.ranks[slot] = 0

    def slot_a(self, slot: int) -> torch.Tensor:
        """[in, W]: slot `slot`'s block of ``a`` (tests)."""
        return self.a[:, slot * self.width:(slot + 1) * self.width]

    def slot_b(self, slot: int) -> torch.Tensor:
        """[W, out]: slot `slot`'s block of ``b`` (tests)."""
        return self.b[slot * self.width:(slot + 1) * self.width]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (this linear's output for ``x [T, in]``) plus the step's adapter deltas, in place."""
        step = _step
        if step is None or not step.segments:
            return y
        if self._op is not None and x.dtype == torch.float32 and x.stride(1) == 1 and y.stride(1) == 1:
            self._op(x, y, self.a, self.b, self.ranks, self.part_sizes, step.segments, 0)
            return y
        segments = step.segments
        for i in range(0, len(segments), 3):
            begin, end, slot = segments[i:i + 3]
            rank = int(self.ranks[slot])
            if rank == 0 or begin == end:
                continue
            cols = slice(slot * self.width, slot * self.width + len(self.part_sizes) * rank)
            y[begin:end].addmm_(x[begin:end] @ self.a[:, cols], self.b[cols])  # b is zero off each part's columns
        return y
