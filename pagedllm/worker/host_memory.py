"""glibc's malloc, set once by the processes that run a model on the CPU (the engine core, tensor-parallel workers).

glibc serves a request of at least its mmap threshold by a fresh mapping, returned to the system at free,
and smaller ones from its heap, whose freed pages it keeps. The threshold starts at 128 KiB and rises,
up to 32 MiB, to the size of each mapped block freed: after loading, every buffer of a long step but the
MLP's largest two (a 2048-token step of a 1B model: hidden states, residual, q/k/v, attention and
projection outputs, 16-24 MiB each) comes from the heap. Freed in another order than they were taken and
mixed with small long-lived allocations, they leave holes the heap cannot give back: the step's peak
grew with every layer (+200 MiB of free heap pages still resident at its end, docs/benchmarks.md
"Memory at the 1B shape"), and a smaller MLP buffer only added to the heap instead of the mappings.

A fixed threshold (``MMAP_THRESHOLD``, which also stops it moving) keeps every buffer from that size up
out of the heap, so the resident set follows what is live. At 4 MiB, a 256-row step's 2-3 MiB buffers (q/k/v,
attention and projection outputs, bf16 activations) still came from the heap and left it ~36 MiB larger after
the first long prompt, its peak ~27 MiB above what 1 MiB gives (docs/benchmarks.md "Memory at the 1B shape").
A one-user decode step's buffers stay below 1 MiB; a mapping costs its page faults, a small part of the
matmul that fills it. ``TRIM_THRESHOLD`` is glibc's own choice for such a threshold (twice it): the top of the heap
is given back only past it, so the heap does not shrink and regrow at every step.
``PAGEDLLM_DISABLE_MALLOC_TUNING=1`` leaves glibc's defaults (A/B runs). Elsewhere than glibc: nothing.
"""

from __future__ import annotations

import ctypes
import logging

from pagedllm import envs

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20
"""Bytes: buffers this large and larger are mapped and given back at free."""
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Bytes of free memory at the top of the heap above which glibc gives it back."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        return libc
    except (OSError, AttributeError):
        return None


def configure_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (module docstring); whether they were set."""
    if envs.PAGEDLLM_DISABLE_MALLOC_TUNING:
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if ok:
        logger.info("malloc: buffers of %d MiB and more are mapped and returned at free", MMAP_THRESHOLD >> 20)
    return ok

