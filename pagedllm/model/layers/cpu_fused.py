"""The compiled small per-layer ops (``csrc/fused_ops.cpp``) for CPU float32, with their gate.

At decode a layer's norms, rotary and activation each cost several ATen calls whose dispatch and
OpenMP fork/join dwarf their arithmetic at 14 rows x 576; each op here is one call that stays on
the calling thread below a size worth forking for. The layers keep their torch code as the
reference definition and call these only when ``usable(tensor)``: the compiled library is loaded
(``cpu_op.load()``, so ``PAGEDLLM_DISABLE_CPU_OP=1`` turns these off too), the tensor is a CPU
float32 one, and ``PAGEDLLM_DISABLE_FUSED_CPU_OPS`` is unset (an A/B switch for these ops alone,
leaving the compiled attention on).

Rounding: rotary is bit-exact with the torch reference; the norm's sum of squares and SiLU's exp
differ from torch's by a few ulps (tests/model/test_fused_ops.py).
"""

from __future__ import annotations

import os

import torch

DISABLE_ENV = "PAGEDLLM_DISABLE_FUSED_CPU_OPS"

_ops: list = []  # [] until resolved; then [None] (unusable) or [namespace of the op overloads]


class _Ops:
    def __init__(self) -> None:
        ns = torch.ops.pagedllm
        self.rms_norm = ns.rms_norm_cpu.default
        self.add_rms_norm = ns.add_rms_norm_cpu.default
        self.rotary_qk = ns.rotary_qk_cpu.default
        self.silu_and_mul = ns.silu_and_mul_cpu.default


def ops() -> _Ops | None:
    """The op overloads, or None where they are off or unavailable (resolved once per process)."""
    if not _ops:
        from pagedllm.model.attention import cpu_op

        usable = (os.environ.get(DISABLE_ENV, "") in ("", "0") and cpu_op.load()
                  and hasattr(torch.ops.pagedllm, "rms_norm_cpu"))
        _ops.append(_Ops() if usable else None)
    return _ops[0]


def reset() -> None:
    """Resolve again at the next call (tests switching the environment)."""
    _ops.clear()


def usable(x: torch.Tensor) -> _Ops | None:
    """The ops when they handle ``x`` (CPU float32), else None: the caller uses the torch reference."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return ops()
