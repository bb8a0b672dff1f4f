"""Adapter weights inside the model: fixed slots on each patched linear, and the step's rows by slot.

A patched linear (qkv_proj, o_proj, gate_up_proj, down_proj) holds every slot's A and B. Slot s's adapter of
rank r is, as matrices (``slot_a``, ``slot_b``; ``W = n_parts * max_rank``), the fused parts (q, k, v; gate,
up) side by side, B block-diagonal so one product pair covers the fused output::

    A_s  [in, W]    columns p*r .. p*r + r - 1               = A^T of part p (zero past n_parts * r)
    B_s  [W, out]   those rows, columns of part p            = (B of part p * scaling)^T; all else zero

stored in panels of 16 columns for the compiled kernel (``a [L, PA, in, 16]``: A_s's columns; ``b [L, PB,
max_rank, 16]``: each part's output columns in panels of their own, row j = part p's row p*r + j of B_s),
so a slot's share is read as a few linear runs; ``ranks [L]`` says r per slot (0: none on this linear).

The runner puts each adapter's rows side by side (base rows first), so a step's adapted rows are a few
segments ``(begin, end, slot)`` (``LoRAStep``). ``LoRASlots.apply`` adds their deltas in one call of the
compiled ``lora_sgmv_cpu`` (csrc/lora_sgmv*.cpp), which shrinks each segment by its own slot's
``n_parts * r`` columns and expands by its own ``r`` rows, part by part: the arithmetic and memory of the
adapters present. A step streams the slots of every adapter present (19.5 MB for a rank-16 adapter of the
default model), so the manager cuts all linears' slots from one ``SlotArena`` on 2 MB huge pages, in the
order a step reads them. The fused decoder step (csrc/decoder_layer.cpp) calls the same op on the same
arguments, so LoRA steps stay on it with the same sums. Without the compiled op (another device or
dtype) each segment runs as a torch product pair on the unpacked matrices.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedllm.model.forward_context import get_lora_segments, set_lora_segments


@dataclass(slots=True)
class LoRAStep:
    """One step's adapted rows."""

    segments: list[int]
    """``[begin, end, slot, begin, end, slot, ...]`` over the batch's rows; rows in none are the base model's."""


@contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    """Make `step` the rows every patched linear adapts during this block (the forward pass); None: none. The
    segments travel in the model's forward context, where the layers read them."""
    with set_lora_segments([] if step is None else step.segments):
        yield


current_segments = get_lora_segments
"""The segments of the step in progress ([] outside ``lora_step`` or for a step without adapters)."""


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


LANES = 16
"""Columns per panel of the packed slots (lora_sgmv.h's kLanes)."""


def _panels(columns: int) -> int:
    return -(-columns // LANES)


def slot_shapes(in_features: int, part_sizes: Sequence[int], max_loras: int,
                max_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``LoRASlots.a`` and ``.b`` for these arguments."""
    width = len(part_sizes) * max_rank
    return ((max_loras, _panels(width), in_features, LANES),
            (max_loras, sum(_panels(size) for size in part_sizes), max_rank, LANES))


class SlotArena:
    """One zeroed buffer that the slots of many linears are cut from, in the order they are taken: on 2 MB
    transparent huge pages where the platform gives them (``huge_pages.zeros``; a plain buffer elsewhere).
    At 4 KB pages each slot read is a TLB miss and a cut hardware-prefetch stream every 4 KB; the kernel alone
    over a decode step's 120 linears took 0.82-0.90x the time on huge pages (docs/benchmarks.md, "Kernel choices behind the defaults")."""

    ALIGN = 64

    def __init__(self, nbytes: int, device: torch.device) -> None:
        from pagedllm.model import huge_pages

        if device.type == "cpu":
            self.buffer = huge_pages.zeros((max(nbytes, 1),), torch.uint8)
        else:
            self.buffer = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)
        self.offset = 0

    @classmethod
    def nbytes(cls, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> int:
        """The arena size that holds tensors of these shapes."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(-(-math.prod(shape) * size // cls.ALIGN) * cls.ALIGN for shape in shapes)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next zeroed contiguous tensor of `shape` (a view of the arena, 64-byte aligned)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        assert self.offset + nbytes <= self.buffer.numel(), "the arena was sized for fewer tensors"
        view = self.buffer[self.offset:self.offset + nbytes].view(dtype).view(shape)
        self.offset += -(-nbytes // self.ALIGN) * self.ALIGN
        return view


class LoRASlots:
    """The adapter slots of one linear whose output is the concatenation of parts of `part_sizes` features."""

    def __init__(self, in_features: int, part_sizes: Sequence[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, arena: SlotArena | None = None) -> None:
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        self.part_panels = [_panels(size) for size in self.part_sizes]
        self.panel_offsets = [sum(self.part_panels[:i]) for i in range(len(self.part_panels))]
        self.in_features = in_features
        self.max_rank = max_rank
        self.width = len(self.part_sizes) * max_rank
        a_shape, b_shape = slot_shapes(in_features, part_sizes, max_loras, max_rank)
        if arena is None:
            self.a = torch.zeros(a_shape, dtype=dtype, device=device)
            self.b = torch.zeros(b_shape, dtype=dtype, device=device)
        else:
            self.a, self.b = arena.take(a_shape, dtype), arena.take(b_shape, dtype)
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)  # updated in place: the fused step holds it
        self._op = compiled_op() if self.a.is_cpu and dtype == torch.float32 else None

    @property
    def compiled(self) -> bool:
        """Whether ``apply`` runs the compiled op (the fused decoder step can take these slots)."""
        return self._op is not None

    def set_slot(self, slot: int, rank: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Hold one adapter in `slot`: parts[p] is (A [rank, in], scaled B [out_p, rank]) of part p, or None."""
        self.clear_slot(slot)
        a_block = torch.zeros(self.in_features, self.a.shape[1] * LANES, dtype=self.a.dtype)  # A_s, padded
        for p, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            size, panels = self.part_sizes[p], self.part_panels[p]
            assert a.shape == (rank, self.in_features) and b.shape == (size, rank), (a.shape, b.shape)
            a_block[:, p * rank:(p + 1) * rank] = a.t()
            b_block = torch.zeros(self.max_rank, panels * LANES, dtype=self.b.dtype)
            b_block[:rank, :size] = b.t()
            first = self.panel_offsets[p]
            self.b[slot, first:first + panels] = b_block.view(self.max_rank, panels, LANES).transpose(0, 1)
        self.a[slot] = a_block.view(self.in_features, -1, LANES).transpose(0, 1)
        self.ranks[slot] = rank

    def clear_slot(self, slot: int) -> None:
        self.a[slot] = 0
        self.b[slot] = 0
        self.ranks[slot] = 0

    def slot_a(self, slot: int) -> torch.Tensor:
        """[in, W]: slot `slot`'s A_s, unpacked (a copy)."""
        return self.a[slot].transpose(0, 1).reshape(self.in_features, -1)[:, :self.width]

    def slot_b(self, slot: int) -> torch.Tensor:
        """[W, out]: slot `slot`'s B_s, unpacked (a copy)."""
        rank = int(self.ranks[slot])
        out = torch.zeros(self.width, sum(self.part_sizes), dtype=self.b.dtype, device=self.b.device)
        for p, (offset, size) in enumerate(zip(self.part_offsets, self.part_sizes)):
            first, panels = self.panel_offsets[p], self.part_panels[p]
            block = self.b[slot, first:first + panels, :rank].transpose(0, 1).reshape(rank, panels * LANES)
            out[p * rank:(p + 1) * rank, offset:offset + size] = block[:, :size]
        return out

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (this linear's output for ``x [T, in]``) plus the step's adapter deltas, in place."""
        segments = get_lora_segments()
        if not segments:
            return y
        if self._op is not None and x.dtype == torch.float32 and x.stride(1) == 1 and y.stride(1) == 1:
            self._op(x, y, self.a, self.b, self.ranks, self.part_sizes, segments, 0)
            return y
        for i in range(0, len(segments), 3):
            begin, end, slot = segments[i:i + 3]
            columns = len(self.part_sizes) * int(self.ranks[slot])
            if columns == 0 or begin == end:
                continue
            y[begin:end].addmm_(x[begin:end] @ self.slot_a(slot)[:, :columns], self.slot_b(slot)[:columns])
        return y
