"""Large CPU buffers on 2 MB transparent huge pages (Linux), for the memory a step streams through.

A decode step reads every weight and every running sequence's KV blocks once; at 4 KB pages that
is a TLB miss every 4 KB and a hardware-prefetch stream cut at every page boundary. Measured on a
2-vCPU Xeon (session 6, docs/benchmarks.md): the compiled attention op over KV blocks scattered
through a 4 GB cache ran 1.14x faster per layer at 14 sequences x 700 tokens with the cache on huge
pages, and the compiled GEMM over the default model's 120 packed weights 1.03-1.04x faster.

Most kernels leave transparent huge pages at ``madvise`` (only regions that ask get them), so
``empty`` over-allocates by 2 MB, aligns the data to a 2 MB boundary and asks with
``madvise(MADV_HUGEPAGE)`` before any page is touched. Where huge pages are off (``never``), on
other systems, for small buffers, or with ``PAGEDLLM_DISABLE_HUGE_PAGES=1`` (an A/B switch), it is
a plain ``torch.empty``. Values and shapes never differ: only where the pages come from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_DISABLE_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE_BYTES
"""Smaller buffers are not worth a 2 MB over-allocation."""
_MADV_HUGEPAGE = 14
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"

_state: dict[str, object] = {}


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
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    if "madvise" not in _state:
        _state["madvise"] = None
        if sys.platform.startswith("linux") and thp_mode() in ("always", "madvise"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                libc.madvise.restype = ctypes.c_int
                _state["madvise"] = libc.madvise
            except (OSError, AttributeError) as exc:
                logger.info("huge pages off: no madvise (%s)", exc)
    return _state["madvise"] is not None


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where ``available()`` (see module doc).

    The tensor is a view at a 2 MB-aligned offset into a slightly larger buffer, so its
    ``storage_offset()`` may be nonzero; it is contiguous and owns its storage like any tensor."""
    numel = 1
    for size in shape:
        numel *= int(size)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not available():
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    advised = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES  # whole huge pages only
    if _state["madvise"](ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(advised), _MADV_HUGEPAGE) != 0:
        if not _state.get("warned"):
            logger.info("madvise(MADV_HUGEPAGE) failed (errno %d); buffers stay on 4 KB pages", ctypes.get_errno())
            _state["warned"] = True
        return torch.empty(tuple(shape), dtype=dtype)
    return raw[offset : offset + nbytes].view(dtype).view(tuple(shape))


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``empty`` filled with zeros (the fill is what first touches, hence places, the pages)."""
    return empty(shape, dtype).zero_()

