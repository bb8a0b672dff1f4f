"""Adapter weights inside the model: fixed slots on each patched linear, and the step's row groups.

A patched linear (qkv_proj, o_proj, gate_up_proj, down_proj) holds, per slot, its adapters' A and B side by
side for each fused part (q, k, v; gate, up), B block-diagonal so one GEMM pair covers the fused output::

    a[slot]  [n_parts*R, in]    rows  p*r .. p*r+r      = A of part p (r = the slot's rank, R = max rank)
    b[slot]  [n_parts*R, out]   rows  p*r .. p*r+r, columns of part p = (B of part p * scaling)^T

A part the adapter does not target stays zero. ``LoRASlots.apply`` adds ``(x[rows] a^T) b`` to the
linear's output for each group ``(slot, start, end)`` of the step (set by ``lora_row_groups``); rows
outside every group (base-model requests) are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

RowGroup = tuple[int, int, int]  # (slot, first row, end row): rows [start, end) run this slot's adapter

_groups: Sequence[RowGroup] = ()


@contextmanager
def lora_row_groups(groups: Sequence[RowGroup]) -> Iterator[None]:
    """Make `groups` the row groups every patched linear applies during this block (the forward pass)."""
    global _groups
    previous, _groups = _groups, groups
    try:
        yield
    finally:
        _groups = previous


class LoRASlots:
    """The adapter slots of one linear whose output is the concatenation of parts of `part_sizes` features."""

    def __init__(self, in_features: int, part_sizes: Sequence[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        width = len(self.part_sizes) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, sum(self.part_sizes), dtype=dtype, device=device)
        self.widths = [0] * max_loras
        """Columns of a[slot]/b[slot] in use (n_parts * the slot's rank); 0 = empty."""

    def set_slot(self, slot: int, rank: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Hold one adapter in `slot`: parts[p] is (A [rank, in], scaled B [out_p, rank]) of part p, or None."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for p, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            rows = slice(p * rank, (p + 1) * rank)
            cols = slice(self.part_offsets[p], self.part_offsets[p] + self.part_sizes[p])
            assert a.shape == (rank, self.a.shape[2]) and b.shape == (self.part_sizes[p], rank), (a.shape, b.shape)
            self.a[slot, rows] = a
            self.b[slot, rows, cols] = b.t()
        self.widths[slot] = len(parts) * rank

    def clear_slot(self, slot: int) -> None:
        self.widths[slot] = 0

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (this linear's output for ``x [T, in]``) plus each group's delta, in place: one shrink
        (``[rows, in] x [in, n*r]``) and one expand (``[rows, n*r] x [n*r, out]``) GEMM per adapter present."""
        for slot, start, end in _groups:
            width = self.widths[slot]
            shrunk = torch.mm(x[start:end], self.a[slot, :width].t())  # [rows, n*r]
            y[start:end].addmm_(shrunk, self.b[slot, :width])  # += [rows, out]
        return y
