"""The compiled small-row-count GEMM (``csrc/cpu_gemm*.cpp``) for CPU float32 linears.

``pack(weight)`` copies an ``[out, in]`` weight once into panels of NR output columns, each
K-major and contiguous (``[panels, in, NR]``, the last panel zero-padded): NR = 32 for the
AVX-512 kernel, 16 for the AVX2 + FMA one. ``gemm(x, packed, bias, n)`` is then ``x W^T + bias``
(float32; only the summation order differs from MKL's). The op infers the kernel from the panel
width, so a weight packed for AVX2 runs the AVX2 kernel even on an AVX-512 CPU
(``PAGEDLLM_CPU_GEMM_ISA=avx2`` packs that way: a test and benchmark hook).

Used only when the compiled library loads (``cpu_op.load()``; ``PAGEDLLM_DISABLE_CPU_OP=1``
turns it off too), the CPU has AVX2 + FMA, and ``PAGEDLLM_DISABLE_CPU_GEMM`` is unset (an A/B
switch for this GEMM alone); otherwise ``pack`` returns None and the linears keep MKL / F.linear.

Packed weights live on 2 MB transparent huge pages (``pagedllm.model.huge_pages``): one call streams
the whole weight, and at 4 KB pages that is a TLB miss and a cut prefetch stream every 4 KB. Most
weights (1.3-7 MB for the default model; q and o under huge_pages' 4 MB minimum) are handed out
as 64-byte-aligned slices of shared 64 MB chunks, in packing order, so the small ones get huge
pages too and a layer's weights lie next to each other in the order a step reads them. Weights
over a quarter chunk (the LM head) get a huge-page buffer of their own. A chunk is freed when the
last slice of it is; the arena keeps only a weak reference to the newest slice.
"""

from __future__ import annotations

import logging
import weakref

import torch

from pagedllm import envs
from pagedllm.model import huge_pages

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_DISABLE_CPU_GEMM"
ISA_ENV = "PAGEDLLM_CPU_GEMM_ISA"
ISA_CODES = {"": 0, "best": 0, "avx2": 1, "avx512": 2}

ARENA_CHUNK_FLOATS = 16 << 20
"""64 MB: 32 huge pages per chunk; a chunk's untouched tail pages are never made resident."""
ALIGN_FLOATS = 16
"""Slices start on 64-byte (cache-line) boundaries."""

_state: dict[str, object] = {}
_arena: dict[str, object] = {"last": None, "end": 0, "limit": 0}


def _log_once(reason: str) -> None:
    if _state.get("logged") != reason:
        logger.info("compiled CPU GEMM off (%s); the linears use MKL / F.linear", reason)
        _state["logged"] = reason


def panel_width(isa: str | None = None) -> int:
    """Columns per panel to pack for (``isa``: None = ``PAGEDLLM_CPU_GEMM_ISA`` or the best the
    CPU runs, else 'avx512' / 'avx2'); 0 when the GEMM is off or unusable here."""
    if envs.PAGEDLLM_DISABLE_CPU_GEMM:
        _log_once(f"{DISABLE_ENV} is set")
        return 0
    from pagedllm.model.attention import cpu_op

    if not cpu_op.load():
        _log_once(f"compiled library unavailable: {cpu_op.unavailable_reason()}")
        return 0
    if not hasattr(torch.ops.pagedllm, "gemm_panel_width"):
        _log_once("the loaded library predates it")
        return 0
    name = (envs.PAGEDLLM_CPU_GEMM_ISA if isa is None else isa).lower()
    if name not in ISA_CODES:
        raise ValueError(f"{ISA_ENV}={name!r}: expected one of avx512, avx2, best")
    width = int(torch.ops.pagedllm.gemm_panel_width(ISA_CODES[name]))
    if width == 0:
        _log_once(f"this CPU has no {name or 'AVX2 + FMA'}")
    return width


def pack(weight: torch.Tensor, isa: str | None = None) -> torch.Tensor | None:
    """``weight [out, in]`` (any strides) packed as ``[panels, in, NR]``, or None where the GEMM
    is off or the weight is not a 2-D float32 CPU tensor."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    nr = panel_width(isa)
    if nr == 0:
        return None
    n, k = weight.shape
    num_panels = -(-n // nr)
    # Panel by panel, so the transient copy is one panel, not the whole (padded) weight.
    packed = _arena_empty(num_panels, k, nr)
    for p in range(num_panels):
        cols = weight[p * nr : (p + 1) * nr]  # [<= nr, in]
        packed[p, :, : cols.shape[0]].copy_(cols.t())
        if cols.shape[0] < nr:
            packed[p, :, cols.shape[0] :].zero_()
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x [M, in] @ W^T (+ bias)`` -> ``[M, n]`` with W packed by ``pack``; ``x`` 2-D float32
    with dense rows (``stride(1) == 1``), else the op raises."""
    return torch.ops.pagedllm.gemm_packed_cpu(x, packed, bias, n)


def chunk_max_blocks(value: int = -1) -> int:
    """The kernel sweeps a panel in K-chunks, all row blocks per chunk, for 2..this many blocks of
    rows (``csrc/cpu_gemm_kernel.h``). ``value``: 1 = never (the whole-panel schedule, for A/B
    runs), 0 = the default (4), negative = only read; returns the previous setting."""
    return int(torch.ops.pagedllm.gemm_chunk_max_blocks(value))


def far_prefetch(value: int = -1) -> int:
    """The kernel's second, far software prefetch (to L2): 1 = on (the default), 0 = off (as
    before it, for A/B runs), negative = only read; returns the previous setting."""
    return int(torch.ops.pagedllm.gemm_far_prefetch(value))


def _arena_empty(*shape: int) -> torch.Tensor:
    """An uninitialised contiguous float32 tensor: the next slice of the current chunk (a view
    sharing the chunk's storage), a new chunk's first slice, or its own buffer if large."""
    numel = 1
    for size in shape:
        numel *= size
    if numel > ARENA_CHUNK_FLOATS // 4:
        return huge_pages.empty(shape, torch.float32)
    last = _arena["last"]() if _arena["last"] is not None else None
    start = -(-int(_arena["end"]) // ALIGN_FLOATS) * ALIGN_FLOATS
    if last is None or start + numel > int(_arena["limit"]):
        chunk = huge_pages.empty((ARENA_CHUNK_FLOATS + ALIGN_FLOATS,), torch.float32)
        base = chunk.storage_offset() + (-chunk.data_ptr() % 64) // 4
        storage, start, limit = chunk.untyped_storage(), base, base + ARENA_CHUNK_FLOATS
    else:
        storage, limit = last.untyped_storage(), int(_arena["limit"])
    strides, stride = [], 1
    for size in reversed(shape):
        strides.insert(0, stride)
        stride *= size
    view = torch.empty(0).set_(storage, start, shape, strides)
    _arena.update(last=weakref.ref(view), end=start + numel, limit=limit)
    return view
