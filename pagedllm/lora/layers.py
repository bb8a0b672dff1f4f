"""Adapter weights inside the model: fixed slots on each patched linear, and the step's rows by slot.

A patched linear (qkv_proj, o_proj, gate_up_proj, down_proj) holds every slot's A and B in two matrices,
slot s owning columns (rows of b) ``[s*W, (s+1)*W)``, ``W = n_parts * max_rank``; inside its block the fused
parts (q, k, v; gate, up) sit side by side, B block-diagonal so one GEMM pair covers the fused output::

    a  [in, L*W]    columns s*W + p*r .. s*W + p*r + r     = A^T of part p of slot s's adapter (rank r)
    b  [L*W, out]   those rows, columns of part p           = (B of part p * scaling)^T; all else zero

``LoRASlots.apply`` adds the delta of the step's adapted rows (``LoRAStep``: the runner puts base-model rows
first, so they are a suffix ``[start, T)``) in three ops, whatever the number of adapters::

    s = x[start:] @ a           # [rows, L*W]  shrink, every slot at once
    s *= mask                   # keep each row's own slot block (mask[row, col] = slot(row) == col // W)
    y[start:] += s @ b          # [rows, out]  expand

Measured first as one GEMM pair per adapter present (rows grouped by slot): 4 adapters on the Alpaca trace
ran at 0.12x the base on this 2-core machine, the ~16 small ops per linear a step drowned in thread wake-ups;
the masked pair does a little more arithmetic (L*W columns for every adapted row) in 4x fewer ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from pagedllm.model.layers import cpu_gemm
from pagedllm.model.layers.linear import GEMM_ROWS


class LoRAStep:
    """One step's adapted rows: rows ``[start, T)`` of the batch, ``row_slots[i]`` the slot of row
    ``start + i`` (-1: a base-model row among them)."""

    def __init__(self, start: int, row_slots: torch.Tensor, max_loras: int) -> None:
        self.start = start
        self.row_slots = row_slots
        self.max_loras = max_loras
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, L*width]: 1 where the column belongs to the row's slot (built once per width and step)."""
        key = (width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            column_slots = torch.arange(self.max_loras * width, device=self.row_slots.device) // width
            mask = self._masks[key] = (self.row_slots[:, None] == column_slots[None, :]).to(dtype)
        return mask


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


class LoRASlots:
    """The adapter slots of one linear whose output is the concatenation of parts of `part_sizes` features."""

    def __init__(self, in_features: int, part_sizes: Sequence[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        self.width = len(self.part_sizes) * max_rank
        self.a = torch.zeros(in_features, max_loras * self.width, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras * self.width, sum(self.part_sizes), dtype=dtype, device=device)
        self._a_packed = self._b_packed = None  # a^T, b^T packed for the compiled CPU GEMM, when it is on
        self._repack()

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
        self._repack()

    def clear_slot(self, slot: int) -> None:
        block = slice(slot * self.width, (slot + 1) * self.width)
        self.a[:, block] = 0
        self.b[block] = 0
        self._repack()

    def _repack(self) -> None:
        self._a_packed, self._b_packed = _pack(self.a.t()), _pack(self.b.t())

    def slot_a(self, slot: int) -> torch.Tensor:
        """[in, W]: slot `slot`'s block of ``a`` (tests)."""
        return self.a[:, slot * self.width:(slot + 1) * self.width]

    def slot_b(self, slot: int) -> torch.Tensor:
        """[W, out]: slot `slot`'s block of ``b`` (tests)."""
        return self.b[slot * self.width:(slot + 1) * self.width]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (this linear's output for ``x [T, in]``) plus the step's adapter deltas, in place."""
        step = _step
        if step is None:
            return y
        start = step.start
        x = x[start:]
        if self._a_packed is not None and x.shape[0] <= GEMM_ROWS[1] and x.dtype == torch.float32 \
                and x.stride(1) == 1:
            # the compiled GEMM on its own workers: torch.mm's OpenMP regions cost ~10x more on a busy CPU
            shrunk = cpu_gemm.gemm(x, self._a_packed, None, self.a.shape[1])  # [rows, L*W]
            _serial(torch.Tensor.mul_, shrunk, step.mask(self.width, shrunk.dtype))
            _serial(torch.Tensor.add_, y[start:], cpu_gemm.gemm(shrunk, self._b_packed, None, self.b.shape[1]))
            return y
        shrunk = torch.mm(x, self.a)  # [rows, L*W]
        shrunk.mul_(step.mask(self.width, shrunk.dtype))
        y[start:].addmm_(shrunk, self.b)  # += [rows, out]
        return y


SERIAL_ELEMENTS = 32768
"""ATen runs an elementwise op over more elements than this (its grain size) in an OpenMP region; on a busy
CPU that region cost 4.4 ms for a [14, 3072] add that takes microseconds on one thread."""


def _serial(op, out: torch.Tensor, other: torch.Tensor) -> None:
    """``op(out, other)`` in place (contiguous, same shape), in pieces small enough to run on this thread."""
    if out.numel() <= SERIAL_ELEMENTS:
        op(out, other)
        return
    out, other = out.view(-1), other.reshape(-1)
    for i in range(0, out.numel(), SERIAL_ELEMENTS):
        op(out[i:i + SERIAL_ELEMENTS], other[i:i + SERIAL_ELEMENTS])


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [n, k]`` in the compiled GEMM's panel layout ``[panels, k, NR]`` (as cpu_gemm.pack, in a tensor
    of its own: slots are repacked whenever an adapter moves in), or None where that GEMM is off."""
    nr = cpu_gemm.panel_width() if weight.device.type == "cpu" and weight.dtype == torch.float32 else 0
    if nr == 0:
        return None
    n, k = weight.shape
    num_panels = -(-n // nr)
    padded = torch.zeros(num_panels * nr, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(num_panels, nr, k).transpose(1, 2).contiguous()
