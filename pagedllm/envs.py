"""Every ``PAGEDLLM_*`` environment variable: declared, documented and parsed here, and nowhere else.

    from pagedllm import envs
    if envs.PAGEDLLM_DISABLE_HUGE_PAGES: ...

Each attribute is read from ``os.environ`` when it is asked for, not at import, so a test's
``monkeypatch.setenv`` or a benchmark switching a variable between two runs is seen at once.
An unset or empty variable has its default. A switch takes 1/true/yes/on or 0/false/no/off; any
other value, or a number that is not one, raises ValueError naming the variable and what it takes.

The experimental ones (``experimental=True``) are A/B switches and tuning knobs for measurements, documented
as one group apart from the settings a deployment uses.

Four variables are read by the compiled library itself (``csrc/``, when it starts); they are
declared here too, and ``check_compiled_op_env()`` (called before the library loads) refuses a
value the C++ would misread.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _switch(text: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def _zero_one(text: str) -> bool:
    """A switch the C++ reads as "unset or 0 = off, anything else = on": only 0 and 1 mean the same to both."""
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1 (read by the compiled library)")
    return text == "1"


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer in [{low}, {high}]") from None
        if not low <= value <= high:
            raise ValueError(f"expected an integer in [{low}, {high}]")
        return value

    return parse


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip().lower() not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text.strip().lower()

    return parse


def _prefetch(text: str) -> tuple[int, ...]:
    """dist[,mode[,hint]]: up to three integers (the C++ clamps each to its range)."""
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError("expected dist[,mode[,hint]]: up to three comma-separated integers") from None
    if len(values) > 3:
        raise ValueError("expected dist[,mode[,hint]]: up to three comma-separated integers")
    return values


class Variable(NamedTuple):
    doc: str
    """What it does, in one line (docs/configuration.md lists it; the topic pages tell when to use it)."""
    parse: Callable[[str], object]
    """Its text to its value; raises ValueError saying what it takes."""
    default: object = None
    """The value when it is unset or empty; a callable is called then (a default that depends on $HOME)."""
    experimental: bool = False
    """An A/B switch or tuning knob kept for measurements (docs/configuration.md lists these apart): it may
    change or go without notice once its comparison is done; a deployment should not need it."""


VARIABLES: dict[str, Variable] = {
    "PAGEDLLM_CACHE": Variable(
        "Directory for models converted once (the embedded default model, GGUF files); default ~/.cache/pagedllm.",
        lambda text: Path(text).expanduser(), lambda: Path.home() / ".cache" / "pagedllm"),
    "PAGEDLLM_CPU_OP_DIR": Variable(
        "Directory of the compiled CPU library builds; default <sys.prefix>/lib/pagedllm-ops.",
        Path, lambda: Path(sys.prefix) / "lib" / "pagedllm-ops"),
    "PAGEDLLM_DISABLE_CPU_OP": Variable(
        "Switch: never load the compiled CPU library (attention, fused ops and GEMM fall back to torch).",
        _switch, False),
    "PAGEDLLM_DISABLE_FUSED_CPU_OPS": Variable(
        "Switch: the fused small CPU ops (norms, rotary, SiLU) off, the rest of the library on (A/B).",
        _switch, False, experimental=True),
    "PAGEDLLM_DISABLE_FUSED_DECODER": Variable(
        "Switch: run a step's decoder layers op by op from Python instead of in one compiled call (A/B; read "
        "at the first step).",
        _switch, False, experimental=True),
    "PAGEDLLM_DISABLE_CPU_GEMM": Variable(
        "Switch: the linears use MKL instead of the compiled float32 GEMM (A/B).",
        _switch, False, experimental=True),
    "PAGEDLLM_CPU_GEMM_ISA": Variable(
        "Panel layout the compiled GEMM packs for: best (the default), avx512 or avx2 (a test and benchmark hook).",
        _one_of("best", "avx512", "avx2"), "best", experimental=True),
    "PAGEDLLM_DISABLE_HUGE_PAGES": Variable(
        "Switch: large CPU buffers (weights, KV cache) without transparent huge pages (A/B).",
        _switch, False, experimental=True),
    "PAGEDLLM_DISABLE_MALLOC_TUNING": Variable(
        "Switch: the engine core and workers keep glibc's default mmap/trim thresholds (worker/host_memory.py; A/B).",
        _switch, False, experimental=True),
    "PAGEDLLM_DISABLE_BF16_GREEDY_HEAD": Variable(
        "Switch: greedy steps use the float32 LM head instead of the exact bf16 one on AMX CPUs (A/B).",
        _switch, False, experimental=True),
    "PAGEDLLM_DISTRIBUTED_SECRET": Variable(
        "Tensor-parallel shared secret (16+ characters), preferred to --distributed-secret: argv is public.",
        str),
    "PAGEDLLM_API_KEY": Variable(
        "Bearer token `pagedllm serve` accepts when no --api-key is given; unset: no auth.",
        str),
    "PAGEDLLM_DISABLE_OP_POOL": Variable(
        "0 or 1, read by csrc/thread_pool.cpp: 1 runs the compiled ops on torch's OpenMP threads (A/B).",
        _zero_one, False, experimental=True),
    "PAGEDLLM_POOL_SPIN_US": Variable(
        "Microseconds (0-10000, default 50) the compiled ops' workers spin for the next job; csrc/thread_pool.cpp.",
        _int_in(0, 10000), 50, experimental=True),
    "PAGEDLLM_ATTN_PF": Variable(
        "dist[,mode[,hint]]: the CPU attention op's prefetch (0 = none), for A/B runs; csrc/paged_attention_op.cpp.",
        _prefetch, experimental=True),
    "PAGEDLLM_BF16_PREFILL_ROWS": Variable(
        "Rows (0-1000000, default 96; 0 = never) from which a quantized linear with int8 activations multiplies "
        "through bf16 AMX tiles instead, on CPUs with AMX-BF16 only; csrc/quant_gemm_op.cpp.",
        _int_in(0, 1_000_000), 96, experimental=True),
}

COMPILED_OP_VARIABLES = ("PAGEDLLM_DISABLE_OP_POOL", "PAGEDLLM_POOL_SPIN_US", "PAGEDLLM_ATTN_PF",
                         "PAGEDLLM_BF16_PREFILL_ROWS")
"""Read by the compiled library, not by Python; checked before it loads."""


def read(name: str):
    """The one parsing helper: variable `name`'s value, its default when unset or empty; a value its
    parser refuses raises ValueError naming the variable."""
    variable = VARIABLES[name]
    text = os.environ.get(name, "")
    if not text:
        return variable.default() if callable(variable.default) else variable.default
    try:
        return variable.parse(text)
    except ValueError as e:
        raise ValueError(f"{name}={text!r}: {e}") from None


def check_compiled_op_env() -> None:
    """Raise ValueError (naming the variable) when a variable the compiled library reads holds a
    value it would misread (e.g. PAGEDLLM_DISABLE_OP_POOL=false, which the C++ takes as set)."""
    for name in COMPILED_OP_VARIABLES:
        read(name)


def __getattr__(name: str):
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])
