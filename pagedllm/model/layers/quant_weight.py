"""A repacked quantized weight and its product (``QuantizedWeight``), through the compiled kernel of
``csrc/quant_gemm*.cpp``: whether that kernel runs here, which ISA it is asked for, and row lookups of a
repacked weight (the embedding's, a tied LM head's).

The panels are ``layers/quant_layout.py``'s; with int8 activations (``use_int8_activations``) the Q8_0 /
Q4_0 / Q4_1 panels are reordered in place for the int8 kernel, which quantizes x per 32-block; a K-quant, Q5_0 / Q5_1 or
IQ4_NL weight built with ``int8_activations`` takes its int8 layout at the file's size (``kquant.py``, ``q5.py``,
``iq4nl.py``).
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.model.layers import iq4nl, kquant, q5
from pagedllm.model.layers.quant_layout import (
    BF16_KERNEL,
    INT8_KERNEL_TYPE,
    KERNEL_TYPE,
    dequantize_rows_torch,
    repack,
    to_int8_layout,
)

ISA_CODES = {"": 0, "best": 0, "avx2": 1, "avx512": 2}
AT_FILE_SIZE = {t: module for module in (kquant, q5, iq4nl) for t in module.KERNEL_TYPE}
"""The GGUF types whose int8-activation layout is built straight from the file's rows, by the module building it."""
FILE_SIZE_KERNEL = {kt: module for module in (kquant, q5, iq4nl) for kt in module.GGUF_TYPE}
"""The same modules by the kernel types of those layouts."""


def dequantize_rows(qtype: int, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a repacked weight as float32 ``[len(ids), K]`` (values bit for bit gguf's);
    ``qtype`` is the kernel type (``KERNEL_TYPE``). One compiled call (``csrc/step_ops.cpp``) where
    the library has it: the torch form below is ~15 ATen calls, ~0.15 ms of a batch-1 decode step."""
    op = _rows_op()
    if op is not None and qtype != BF16_KERNEL and packed.is_cpu and ids.is_cpu and ids.dtype == torch.int64:
        return op(packed, qtype, ids)  # (the op has no bf16 form: those rows take the torch one)
    if qtype in FILE_SIZE_KERNEL:
        return FILE_SIZE_KERNEL[qtype].rows(qtype, packed, ids)
    return dequantize_rows_torch(qtype, packed, ids)


def _rows_op():
    """The compiled row lookup's C++ callable, or None (looked up once: the library loads before any
    ``QuantizedWeight`` exists)."""
    if "rows" not in _ROWS_OP:
        overload = getattr(torch.ops.pagedllm, "quant_rows_cpu", None) if kernel_available() else None
        _ROWS_OP["rows"] = None if overload is None else getattr(overload.default, "_op", overload.default)
    return _ROWS_OP["rows"]


_ROWS_OP: dict[str, object] = {}


def kernel_isa() -> int:
    """The ISA code this process asks the op for (``PAGEDLLM_CPU_GEMM_ISA``), 0 = the best."""
    return ISA_CODES[envs.PAGEDLLM_CPU_GEMM_ISA]  # envs refuses any other name


def kernel_available() -> bool:
    """Whether the compiled quantized kernel runs here (library loaded, an ISA it supports)."""
    from pagedllm.model.attention import cpu_op

    return (cpu_op.load() and hasattr(torch.ops.pagedllm, "quant_gemm_isa")
            and int(torch.ops.pagedllm.quant_gemm_isa(kernel_isa())) != 0)


def int8_kernel_available() -> bool:
    """Whether the int8-activation kernel runs here (the library has it; AVX2 at least)."""
    return (kernel_available() and hasattr(torch.ops.pagedllm, "quant_gemm_int8_isa")
            and int(torch.ops.pagedllm.quant_gemm_int8_isa(kernel_isa())) != 0)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float32 as the int8 kernel quantizes it: ``(q int8 [M, K], d float32 [M, K/32],
    sum int32 [M, K/32])``, per 32-wide block d = max|x| / 127 and q = rint(x * (127 / max|x|))."""
    return torch.ops.pagedllm.quantize_act_cpu(x)


class QuantizedWeight:
    """One repacked ``[n, k]`` weight and its product ``x W^T (+ bias)``."""

    __slots__ = ("qtype", "kernel_type", "packed", "n", "k", "isa", "_op")

    def __init__(self, qtype: int, raw: torch.Tensor, k: int, int8_activations: bool = False) -> None:
        if not kernel_available():  # loads the library, which registers the op
            raise RuntimeError("the compiled quantized kernel is unavailable here (see cpu_op.unavailable_reason())")
        self.qtype, self.kernel_type, self.n, self.k = qtype, KERNEL_TYPE[qtype], raw.shape[0], k
        if int8_activations and qtype in AT_FILE_SIZE and int8_kernel_available():
            module = AT_FILE_SIZE[qtype]  # at the file's size, never expanded (kquant.py, q5.py)
            self.kernel_type = module.KERNEL_TYPE[qtype]
            self.packed = module.repack(qtype, raw)
        else:
            self.packed = repack(qtype, raw)
        self.isa = kernel_isa()
        overload = torch.ops.pagedllm.quant_gemm_cpu.default
        self._op = getattr(overload, "_op", overload)  # the C++ callable, without OpOverload's wrapper

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., k] @ W^T (+ bias)`` -> ``[..., n]`` float32."""
        if x.dim() != 2 or x.stride(-1) != 1 or x.dtype != torch.float32:
            shape = x.shape
            y = self._op(x.reshape(-1, self.k).float().contiguous(), self.packed, self.kernel_type, self.n, bias,
                         self.isa)
            return y.view(*shape[:-1], self.n)
        return self._op(x, self.packed, self.kernel_type, self.n, bias, self.isa)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized to float32 ``[len(ids), k]``."""
        if self.kernel_type in INT8_KERNEL_TYPE.values():
            raise NotImplementedError("rows of a weight in the int8-activation layout (only linears take it)")
        return dequantize_rows(self.kernel_type, self.packed, ids)

    def use_int8_activations(self) -> bool:
        """Switch this weight to the int8-activation kernel (its panels reordered in place): every later
        ``matmul`` quantizes x per 32-block to int8. False, and nothing changed, for a type it lacks
        (the K-quants' QX, bf16) or where the kernel does not run. A K-quant or Q5 weight built with
        ``int8_activations`` already is in its int8 layout: True."""
        if self.kernel_type in FILE_SIZE_KERNEL:  # took its int8 layout at construction
            return True
        target = INT8_KERNEL_TYPE.get(self.kernel_type)
        if target is None or not int8_kernel_available():
            return False
        to_int8_layout(self.kernel_type, self.packed)
        self.kernel_type = target
        return True
