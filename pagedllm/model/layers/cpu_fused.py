"""The compiled small per-layer ops (``csrc/fused_ops.cpp``) for CPU float32, with their gate.

At decode a layer's norms, rotary and activation each cost several ATen calls whose dispatch and
OpenMP fork/join dwarf their arithmetic at 14 rows x 576; each op here is one call that stays on
the calling thread below a size worth forking for. The layers keep their torch code as the
reference definition and call these only when ``usable(tensor)``: the compiled library is loaded
(``cpu_op.load()``, so ``PAGEDLLM_DISABLE_CPU_OP=1`` turns these off too), the tensor is a CPU
float32 one, and ``PAGEDLLM_DISABLE_FUSED_CPU_OPS`` is unset (an A/B switch for these ops alone,
leaving the compiled attention on).

Rounding: every op equals the torch reference bit for bit (tests/model/test_fused_ops.py). The
norm sums squares in ATen's order and SiLU uses torch's vectorized exp, both for a vector width
that is torch's internal choice: ``calibrate_*`` find it once per process by checking against
torch, and an op that matches no width keeps the torch path (logged).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pagedllm import envs

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_DISABLE_FUSED_CPU_OPS"

chosen: list = []
"""[] until resolved; then [None] (off or unusable) or [the op overloads]. Read in place, not through ``ops()``,
where a step asks: a call per step would cost more than the answer."""


def _norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm in float32 (torch.rms_norm rounds the same: tests/model/test_norm.py)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def calibrate_norm_lanes(rms_norm) -> int | None:
    """The vector width (8 or 16 floats) whose ATen summation order makes ``rms_norm`` equal torch's
    norm bit for bit on this torch build and CPU, or None (then the norms keep the torch path).

    Which width torch's sum kernel uses is its internal choice (8 on AVX2 and, measured, on
    AVX-512 CPUs with torch 2.13), so it is checked here once rather than assumed; the widths
    tried cover a tail of scalars, leftover vectors and a cascade carry."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for hidden in (576, 1000, 4100, 13):
        x = torch.randn(8, hidden, generator=gen) * 4
        weight = torch.randn(hidden, generator=gen) + 1.0
        cases.append((x, weight, _norm_reference(x, weight, 1e-5)))
    for lanes in (8, 16):
        if all(torch.equal(rms_norm(x, w, 1e-5, lanes), ref) for x, w, ref in cases):
            return lanes
    return None


def calibrate_silu_block(silu_and_mul) -> int | None:
    """Floats per step of torch's vectorized SiLU loop (2 vectors: 32 on AVX-512, 16 on AVX2), past
    which a row's tail goes scalar, found by checking ``silu_and_mul`` against torch's SiLU bit for
    bit (rows whose tails differ in the two widths included), or None (then SiLU keeps torch's)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for d in (48, 1536, 40, 13):
        x = torch.randn(3, 2 * d, generator=gen) * 6
        cases.append((x, F.silu(x[:, :d]) * x[:, d:]))
    for block in (32, 16):
        if all(torch.equal(silu_and_mul(x, block), ref) for x, ref in cases):
            return block
    return None


def _direct(overload):
    """The C++ callable behind a ``torch.ops`` overload: calling it skips ``OpOverload.__call__``'s
    Python frame (~0.4 us, ~5 calls a layer per step); the same dispatch and schema checks follow."""
    return getattr(overload, "_op", overload)


class _Ops:
    def __init__(self) -> None:
        ns = torch.ops.pagedllm
        rms_norm, add_rms_norm = _direct(ns.rms_norm_cpu.default), _direct(ns.add_rms_norm_cpu.default)
        with torch.inference_mode():
            lanes = calibrate_norm_lanes(rms_norm)
        if lanes is None:
            logger.warning("the compiled RMSNorm does not round like torch %s here; norms use torch",
                           torch.__version__)
            self.rms_norm = self.add_rms_norm = self.add_rms_norm_ = None
        else:
            add_rms_norm_ = _direct(ns.add_rms_norm_inplace_cpu.default)
            self.rms_norm = lambda x, weight, eps: rms_norm(x, weight, eps, lanes)
            self.add_rms_norm = lambda x, residual, weight, eps: add_rms_norm(x, residual, weight, eps, lanes)
            self.add_rms_norm_ = lambda x, residual, weight, eps: add_rms_norm_(x, residual, weight, eps, lanes)
            """In place: ``residual += x`` and ``x = norm(residual)`` (dense rows, two tensors)."""
        self.norm_lanes = lanes
        silu_and_mul = _direct(ns.silu_and_mul_cpu.default)
        with torch.inference_mode():
            block = calibrate_silu_block(silu_and_mul)
        if block is None:
            logger.warning("the compiled SiLU does not round like torch %s here; SiLU uses torch", torch.__version__)
            self.silu_and_mul = None
        else:
            self.silu_and_mul = lambda x: silu_and_mul(x, block)
        self.silu_block = block
        self.rotary_qk = _direct(ns.rotary_qk_cpu.default)


_resolved: list = []  # the one _Ops instance (or None) resolved for this process


def ops() -> _Ops | None:
    """The op overloads, or None where they are off or unavailable (resolved once per process)."""
    if not chosen:
        if not _resolved:
            from pagedllm.model.attention import cpu_op

            usable = (not envs.PAGEDLLM_DISABLE_FUSED_CPU_OPS and cpu_op.load()
                      and hasattr(torch.ops.pagedllm, "rms_norm_cpu"))
            _resolved.append(_Ops() if usable else None)
        chosen.append(_resolved[0])
    return chosen[0]


def set_enabled(enabled: bool) -> None:
    """Switch the ops off, or back on where they are available, in this process: an A/B switch for
    step profiles (``bench profile --compare-fused-ops``) and tests."""
    chosen.clear()
    if not enabled:
        chosen.append(None)


def reset() -> None:
    """Resolve again at the next call (tests switching the environment)."""
    chosen.clear()
    _resolved.clear()


def usable(x: torch.Tensor) -> _Ops | None:
    """The ops when they handle ``x`` (CPU float32), else None: the caller uses the torch reference."""
    if x.dtype != torch.float32 or not x.is_cpu:  # is_cpu: x.device builds a device object per call
        return None
    return chosen[0] if chosen else ops()  # inlined: this runs ~5 times a layer
