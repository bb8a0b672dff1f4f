"""Large CPU buffers on 2 MB transparent huge pages (Linux), for the memory a step streams through.

A decode step reads every weight and every running sequence's KV blocks once; at 4 KB pages that
is a TLB miss every 4 KB and a hardware-prefetch stream cut at every page boundary. On huge pages
the compiled attention op over scattered KV blocks ran 1.14x faster per layer and the compiled GEMM
1.03-1.04x (docs/benchmarks.md, "Kernel choices behind the defaults").

Most kernels leave transparent huge pages at ``madvise`` (only regions that ask get them), so
``empty`` maps fresh anonymous memory (``mmap``, 2 MB more than asked), aligns the data to a 2 MB
boundary and asks with ``madvise(MADV_HUGEPAGE)`` before any page is touched. Fresh, because memory
from the allocator may be heap space some earlier tensor already touched (4 KB pages, which the
advice no longer changes). Where huge pages are off (``never``), on other systems, for small
buffers, or with ``PAGEDLLM_DISABLE_HUGE_PAGES=1`` (an A/B switch), it is a plain ``torch.empty``.
Values and shapes never differ: only where the pages come from.
"""

from __future__ import annotations

import mmap
import sys

import torch

from pagedllm import envs

DISABLE_ENV = "PAGEDLLM_DISABLE_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE_BYTES
"""Smaller buffers are not worth a 2 MB over-allocation."""
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"

_state: dict[str, bool] = {}


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode ('always', 'madvise', 'never'), or '' if unknown."""
    try:
        text = open(_THP_MODE_FILE).read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def available() -> bool:
    """Whether ``empty`` asks for huge pages here (checked once; the env switch every call)."""
    if envs.PAGEDLLM_DISABLE_HUGE_PAGES:
        return False
    if "ok" not in _state:
        _state["ok"] = (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
                        and thp_mode() in ("always", "madvise"))
    return _state["ok"]


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where ``available()`` (see module doc).

    The tensor is a view at a 2 MB-aligned offset into its own anonymous mapping (kept alive by the
    tensor, unmapped when the last view is freed), so its ``storage_offset()`` may be nonzero."""
    numel = 1
    for size in shape:
        numel *= int(size)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not available():
        return torch.empty(tuple(shape), dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES  # a multiple of the 4 KB page: madvise's unit
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:  # e.g. a kernel built without THP: the buffer works, on 4 KB pages
        pass
    return raw[offset : offset + nbytes].view(dtype).view(tuple(shape))


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``empty`` filled with zeros (the fill is also what first touches, hence places, the pages)."""
    return empty(shape, dtype).zero_()
