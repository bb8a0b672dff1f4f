"""GGUF-quantized weights kept quantized in memory (Q8_0, Q4_0, Q4_1 in their own size; Q4_K, Q5_K,
Q6_K expanded to 12 bits a weight), multiplied by the compiled kernel of ``csrc/quant_gemm*.cpp``.

The loader hands a linear's weight loader a ``QuantTensor`` (the GGUF rows, still quantized)
instead of a float tensor; the loader stores it with ``stage`` (on the parameter, at the row
offset a fused QKV / gate-up shard goes to), which repacks the rows once into the kernel's layout
as soon as they cover the weight (so a load holds one weight's source bytes at a time, not the
file's), and ``finalize`` (from ``process_weights_after_loading``) installs the result::

    GGUF, row-major:     row n = K/32 blocks [d (m) q-bytes]   (Q8: byte j = q_j; Q4: q_j | q_(j+16) << 4)
    repacked, panels:    panel p = rows 16p..16p+15; per K-block:
                         [d x16][m x16 (Q4_1)][byte 0 of 16 rows][byte 1 of 16 rows]...

so one k-step of 16 output rows is one contiguous vector load, widened and scaled in registers
(``csrc/quant_gemm.h``). The repacked weight is the GGUF size exactly; no float32 copy is kept,
and the float parameter is left empty (``[out, 0]``). The dequantized values are bit for bit
gguf's numpy ones, so the product equals the dequantize-then-float32 path up to summation order.

The K-quants (256-weight super-blocks, 6-bit sub-block scales) are expanded once at load into the
kernel's QX panels: per 16 weights a float32 scale ``d * sc`` and min ``-dmin * m`` (each product
exact in float32, as gguf's numpy forms it) and the 4-6 bit values as int8, so the weights are
again gguf's float32 bit for bit, at 12 bits a weight (the files hold 4.5-6.6; float32 is 32).

Tensor parallelism narrows a ``QuantTensor`` like a float tensor: rows freely, columns (a row-
parallel shard) in whole 32-wide blocks. Embedding tables stay quantized too: a lookup
dequantizes only the looked-up rows (``dequantize_rows``, plain torch); a tied LM head multiplies
by the embedding's ``QuantizedWeight`` (found on the shared parameter).

With int8 activations (``--quant-activations``, by default for a GGUF's quantized weights: the loader's
``apply_activation_format``) the loader switches each linear's Q8_0 / Q4_0 / Q4_1 weight to the
int8-activation kernel (``QuantizedWeight.use_int8_activations``): the same panels, each block's quant bytes
reordered in place (``to_int8_layout``, csrc/quant_gemm_int8.h), and the op quantizes x per 32-block to int8.

Where the compiled op is unavailable (not built, ``PAGEDLLM_DISABLE_CPU_OP=1``, no AVX2 + FMA +
F16C), ``finalize`` dequantizes the staged rows into the float parameter instead, with a log line:
the model then runs today's float32 path, just as ``--gguf-dequantize`` would.

With int8 activations the K-quants skip the expansion: the loader marks each parameter
(``mark_int8_activations``) before the weights load, and ``stage`` repacks a marked K-quant weight
straight into the int8 kernel's file-size layout (``kquant.py``, csrc/quant_gemm_kq.h).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pagedllm import envs
from pagedllm.model.layers import kquant

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 2, 3, 8, 12, 13, 14, 30  # GGMLQuantizationType values
QX = 100  # the kernel's expanded layout for the K-quants (csrc/quant_gemm.h), no GGUF type
BF16_KERNEL = 101  # bfloat16 panels (csrc/bf16_gemm.h), no GGUF type
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", BF16: "BF16"}
GGUF_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
               BF16: (1, 2)}
"""(weights, bytes) of one block in the GGUF file."""
KERNEL_TYPE = {Q4_0: Q4_0, Q4_1: Q4_1, Q8_0: Q8_0, Q4_K: QX, Q5_K: QX, Q6_K: QX, BF16: BF16_KERNEL}
PACKED_BLOCK_BYTES = {Q4_0: 32 + 256, Q4_1: 64 + 256, Q8_0: 32 + 512, QX: 256 + 512, BF16_KERNEL: 1024}
"""Bytes of one K-block of a 16-row panel once repacked (csrc/quant_gemm.h), by kernel type."""
BLOCK_K = 32
PANEL_ROWS = 16
SUPPORTED = frozenset((Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K))
"""The GGUF types the GGUF loader keeps as they are (BF16 reaches the kernel from safetensors, ``convert``)."""
ISA_CODES = {"": 0, "best": 0, "avx2": 1, "avx512": 2}
INT8_KERNEL_TYPE = {Q4_0: 112, Q4_1: 113, Q8_0: 118}
"""The int8-activation kernel's types (csrc/quant_gemm_int8.h) by kernel type: the same panels with
each block's quant bytes reordered (``to_int8_layout``)."""
ACTIVATION_FORMATS = ("auto", "none", "int8")
"""``--quant-activations``: int8 quantizes the activations per 32-wide block of a row (one float32 scale
each, as Q8_0) for integer dot products with the linears' quantized weights (the types in
``INT8_KERNEL_TYPE``); none keeps them float32 (the weights dequantized in registers, the exact mode);
auto, the default, is int8 for a GGUF's quantized weights where the int8 kernel runs, else none."""


class QuantTensor:
    """A GGUF weight ``[rows, K]`` still quantized: ``raw`` is ``[rows, K / 32 * block bytes]`` uint8.
    ``narrow`` keeps it quantized (columns in whole blocks); ``materialize`` dequantizes."""

    __slots__ = ("qtype", "raw", "shape")

    def __init__(self, qtype: int, raw: torch.Tensor, k: int) -> None:
        assert qtype in GGUF_BLOCKS and raw.dtype == torch.uint8 and raw.dim() == 2
        assert raw.shape[1] * GGUF_BLOCKS[qtype][0] == k * GGUF_BLOCKS[qtype][1], (raw.shape, k)
        self.qtype, self.raw, self.shape = qtype, raw, torch.Size((raw.shape[0], k))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor:
        if dim == 0:
            return QuantTensor(self.qtype, self.raw.narrow(0, start, length), self.shape[1])
        bk, bb = GGUF_BLOCKS[self.qtype]
        if start % bk or length % bk:  # e.g. a K-quant's 256-wide blocks over 2 ranks of 288 columns
            logger.warning("columns [%d, %d) of a %s weight cut its %d-wide blocks: this shard is dequantized "
                           "to float32", start, start + length, NAMES[self.qtype], bk)
            return self.materialize().narrow(1, start, length)
        return QuantTensor(self.qtype, self.raw.narrow(1, start // bk * bb, length // bk * bb), length)

    def materialize(self) -> torch.Tensor:
        from gguf.quants import dequantize

        if self.qtype == BF16:
            return self.raw.contiguous().view(torch.bfloat16).float()

        array = dequantize(self.raw.contiguous().numpy(), self.qtype)  # [rows, K] float32
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(self.shape))


def repack(qtype: int, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows ``[n, K/32 * block bytes]`` -> the kernel's panels ``[ceil(n/16), K/32, packed
    block bytes]`` (rows past n are zero blocks: they compute zeros the op never stores). In numpy:
    torch's byte-wise strided copies ran ~100x slower here (0.2 s for one 1536 x 576 weight)."""
    if KERNEL_TYPE[qtype] == QX:
        return _repack_expanded(*expand_k_quant(qtype, raw.numpy()))
    if qtype == BF16:  # [P, 16 rows, K/2 pairs, 2] -> [P, K/2, 16 rows, 2]: a k-pair of a panel is 64 bytes
        n, k = raw.shape[0], raw.shape[1] // 2
        num_panels = -(-n // PANEL_ROWS)
        rows = torch.zeros(num_panels * PANEL_ROWS, k, dtype=torch.bfloat16)
        rows[:n] = raw.contiguous().view(torch.bfloat16)
        panels = rows.view(num_panels, PANEL_ROWS, k // 2, 2).transpose(1, 2).contiguous()
        return panels.view(torch.uint8).reshape(num_panels, k // BLOCK_K, PACKED_BLOCK_BYTES[BF16_KERNEL])
    n = raw.shape[0]
    bb = GGUF_BLOCKS[qtype][1]
    nb = raw.shape[1] // bb
    num_panels = -(-n // PANEL_ROWS)
    source = raw.numpy().reshape(n, nb, bb)
    packed = np.empty((num_panels, nb, PACKED_BLOCK_BYTES[qtype]), dtype=np.uint8)
    full = n // PANEL_ROWS
    if full:
        _fill_panels(qtype, packed[:full], source[: full * PANEL_ROWS])
    if full < num_panels:  # the last panel's missing rows: zero blocks
        tail = np.zeros((PANEL_ROWS, nb, bb), dtype=np.uint8)
        tail[: n - full * PANEL_ROWS] = source[full * PANEL_ROWS :]
        _fill_panels(qtype, packed[full:], tail)
    return torch.from_numpy(packed)


def _fill_panels(qtype: int, out: np.ndarray, rows: np.ndarray) -> None:
    """GGUF blocks ``rows [16 p, nb, block bytes]`` into panels ``out [p, nb, packed bytes]`` in one
    strided copy per part, straight into ``out``: no intermediate of the weight's size (a 1 B
    model's embedding is 57-107 MB in Q4_0-Q8_0; the copies once made here doubled the load's peak)."""
    num_panels, nb, _ = out.shape
    scale_bytes = 4 if qtype == Q4_1 else 2  # d (and m) as fp16 at the start of each GGUF block
    blocks = rows.reshape(num_panels, PANEL_ROWS, nb, -1)
    q_bytes = blocks.shape[-1] - scale_bytes
    # [P, 16 rows, nb, d (m), 2 bytes] -> [P, nb, d (m), 16 rows, 2 bytes]
    scales = blocks[..., :scale_bytes].reshape(num_panels, PANEL_ROWS, nb, scale_bytes // 2, 2)
    _shaped(out[..., : PANEL_ROWS * scale_bytes], (num_panels, nb, scale_bytes // 2, PANEL_ROWS, 2))[...] = \
        scales.transpose(0, 2, 3, 1, 4)
    # [P, 16 rows, nb, byte j] -> [P, nb, byte j, 16 rows]
    _shaped(out[..., PANEL_ROWS * scale_bytes :], (num_panels, nb, q_bytes, PANEL_ROWS))[...] = \
        blocks[..., scale_bytes:].transpose(0, 2, 3, 1)


def _shaped(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A view of ``array`` as ``shape``; raises rather than copy (a write into a copy would be lost)."""
    return np.reshape(array, shape, copy=False)


def expand_k_quant(qtype: int, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF K-quant rows ``[n, K/256 * block bytes]`` -> ``(q int8 [n, K], scale, min float32
    [n, K/16])`` with weight = q * scale + min, each term formed as gguf's numpy dequantize does."""
    from gguf.quants import Q4_K as GGUF_Q4_K

    n = raw.shape[0]
    blocks = raw.reshape(-1, GGUF_BLOCKS[qtype][1])  # [n * K/256, bytes]
    num = blocks.shape[0]
    if qtype in (Q4_K, Q5_K):
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = GGUF_Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scale = d * sc.astype(np.float32)  # [num, 8 sub-blocks of 32]
        minv = -(dmin * m.astype(np.float32))
        qs = blocks[:, -128:].reshape(num, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & np.uint8(15)).reshape(num, 8, 32)
        if qtype == Q5_K:
            qh = blocks[:, 16:48].reshape(num, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & np.uint8(1)).reshape(num, 8, 32) << np.uint8(4))
        scale, minv = np.repeat(scale, 2, axis=1), np.repeat(minv, 2, axis=1)  # per 16 weights
    else:  # Q6_K
        scale = blocks[:, 192:208].copy().view(np.int8).astype(np.float32) * \
            blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [num, 16]
        minv = np.zeros_like(scale)
        ql = blocks[:, :128].reshape(num, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(num, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((ql & np.uint8(15)).reshape(num, 8, 32) | ((qh & np.uint8(3)).reshape(num, 8, 32) << np.uint8(4)))
        q = q.astype(np.int8) - np.int8(32)
    return q.astype(np.int8).reshape(n, -1), scale.reshape(n, -1), minv.reshape(n, -1)


def _repack_expanded(q: np.ndarray, scale: np.ndarray, minv: np.ndarray) -> torch.Tensor:
    """(q [n, K], scale, min [n, K/16]) -> QX panels ``[ceil(n/16), K/32, 768]``: per K-block the
    16 rows' scales of both halves, their mins, then 32 k-steps of 16 rows' int8 values."""
    n, k = q.shape
    nb = k // BLOCK_K
    num_panels = -(-n // PANEL_ROWS)

    def panels(a: np.ndarray, per_block: int) -> np.ndarray:  # [n, nb * per_block] -> [P, nb, per_block x 16 rows]
        padded = np.zeros((num_panels * PANEL_ROWS, nb, per_block), dtype=a.dtype)
        padded[:n] = a.reshape(n, nb, per_block)
        out = padded.reshape(num_panels, PANEL_ROWS, nb, per_block).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(out).reshape(num_panels, nb, -1).view(np.uint8)

    packed = np.concatenate([panels(scale, 2), panels(minv, 2), panels(q, BLOCK_K)], axis=-1)
    assert packed.shape[-1] == PACKED_BLOCK_BYTES[QX]
    return torch.from_numpy(packed)


def dequantize_rows(qtype: int, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a repacked weight as float32 ``[len(ids), K]`` (values bit for bit gguf's);
    ``qtype`` is the kernel type (``KERNEL_TYPE``). One compiled call (``csrc/step_ops.cpp``) where
    the library has it: the torch form below is ~15 ATen calls, ~0.15 ms of a batch-1 decode step."""
    op = _rows_op()
    if op is not None and qtype != BF16_KERNEL and packed.is_cpu and ids.is_cpu and ids.dtype == torch.int64:
        return op(packed, qtype, ids)  # (the op has no bf16 form: those rows take the torch one)
    if qtype in kquant.GGUF_TYPE:
        return kquant.rows(qtype, packed, ids)
    return dequantize_rows_torch(qtype, packed, ids)


def _rows_op():
    """The compiled row lookup's C++ callable, or None (looked up once: the library loads before any
    ``QuantizedWeight`` exists)."""
    if "rows" not in _ROWS_OP:
        overload = getattr(torch.ops.pagedllm, "quant_rows_cpu", None) if kernel_available() else None
        _ROWS_OP["rows"] = None if overload is None else getattr(overload.default, "_op", overload.default)
    return _ROWS_OP["rows"]


_ROWS_OP: dict[str, object] = {}


def dequantize_rows_torch(qtype: int, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``dequantize_rows`` in torch ops: the reference, and the path without the compiled op."""
    num_panels, nb, _ = packed.shape
    lane = (ids % PANEL_ROWS).view(-1, 1, 1)
    blocks = packed[ids // PANEL_ROWS]  # [T, nb, block bytes]
    t = blocks.shape[0]

    def per_row(start: int, width: int) -> torch.Tensor:  # [T, nb, width / 16] bytes of each row's lane
        part = blocks[:, :, start : start + width].reshape(t, nb, width // PANEL_ROWS, PANEL_ROWS)
        return part.gather(3, lane.unsqueeze(-1).expand(t, nb, width // PANEL_ROWS, 1)).squeeze(-1)

    def scale(start: int) -> torch.Tensor:  # [T, nb, 1] float32: the fp16 of each row's lane
        part = blocks[:, :, start : start + 32].reshape(t, nb, PANEL_ROWS, 2)
        picked = part.gather(2, lane.unsqueeze(-1).expand(t, nb, 1, 2))  # [T, nb, 1, 2]
        return picked.reshape(t, nb, 2).contiguous().view(torch.float16).float()

    if qtype == BF16_KERNEL:  # [T, nb, 16 k-pairs x 16 rows x 2] bf16 -> each row's lane
        w = blocks.view(torch.bfloat16).reshape(t, nb * BLOCK_K // 2, PANEL_ROWS, 2)
        picked = w.gather(2, lane.view(-1, 1, 1, 1).expand(t, nb * BLOCK_K // 2, 1, 2))
        return picked.reshape(t, nb * BLOCK_K).float()
    if qtype == QX:
        def halves(start: int) -> torch.Tensor:  # [T, nb, 2, 1] float32 of each row's lane
            part = blocks[:, :, start : start + 128].contiguous().view(torch.float32).reshape(t, nb, 2, PANEL_ROWS)
            return part.gather(3, lane.unsqueeze(-1).expand(t, nb, 2, 1))

        q = per_row(256, 512).view(torch.int8).float().reshape(t, nb, 2, 16)
        return (q * halves(0) + halves(128)).reshape(t, nb * BLOCK_K)
    d = scale(0)
    if qtype == Q8_0:
        q = per_row(32, 512).view(torch.int8).float()  # [T, nb, 32]
        return (q * d).reshape(t, nb * BLOCK_K)
    b = per_row(64 if qtype == Q4_1 else 32, 256)  # [T, nb, 16 bytes]: k = j low, j + 16 high
    q = torch.cat([b & 15, b >> 4], dim=-1).float()  # [T, nb, 32]
    if qtype == Q4_0:
        return ((q - 8) * d).reshape(t, nb * BLOCK_K)
    m = scale(32)
    return (d * q + m).reshape(t, nb * BLOCK_K)


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


def to_int8_layout(kernel_type: int, packed: torch.Tensor) -> None:
    """Reorder, in place, each K-block's quant bytes of ``packed`` (panels of ``kernel_type``, Q8_0 / Q4_0 /
    Q4_1) from ``[byte j][16 rows]`` to ``[j / 4][16 rows][j % 4]``, the int8 kernel's dword per row
    (csrc/quant_gemm_int8.h); Q8_0's bytes also + 128 (XOR 0x80). One weight's quant bytes are copied
    once on the way; the weight is then only in the new layout."""
    offset = 64 if kernel_type == Q4_1 else 32
    array = packed.numpy()
    num_panels, nb, bb = array.shape
    q_bytes = bb - offset
    q = array[..., offset:]  # a view: [P, nb, j, 16 rows]
    reordered = q.reshape(num_panels, nb, q_bytes // 64, 4, PANEL_ROWS).transpose(0, 1, 2, 4, 3).copy()
    if kernel_type == Q8_0:
        reordered ^= np.uint8(0x80)
    q[...] = reordered.reshape(num_panels, nb, q_bytes)


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
        if int8_activations and qtype in kquant.KERNEL_TYPE and int8_kernel_available():
            self.kernel_type = kquant.KERNEL_TYPE[qtype]  # at the file's size, never expanded (kquant.py)
            self.packed = kquant.repack(qtype, raw)
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
        (the K-quants' QX, bf16) or where the kernel does not run. A K-quant weight built with
        ``int8_activations`` already is in its int8 layout: True."""
        if self.kernel_type in kquant.GGUF_TYPE:  # a K-quant that took its int8 layout at construction
            return True
        target = INT8_KERNEL_TYPE.get(self.kernel_type)
        if target is None or not int8_kernel_available():
            return False
        to_int8_layout(self.kernel_type, self.packed)
        self.kernel_type = target
        return True


def stage(param: nn.Parameter, row_offset: int, loaded: QuantTensor) -> None:
    """Keep ``loaded`` (rows ``[row_offset, row_offset + rows)`` of ``param``) for ``finalize``.

    The shard that completes ``param`` (all rows, one type, the kernel here) repacks them at once,
    and the staged shards are let go: the loader's source bytes (views of the GGUF's map) are then
    never held for more than the few shards of one fused weight, and the model's peak while loading
    is its repacked weights plus one tensor, not plus the file."""
    if loaded.shape[1] != param.shape[1]:
        raise ValueError(f"a quantized shard of {loaded.shape[1]} columns for a weight of {param.shape[1]}")
    shards = param.__dict__.setdefault("quant_shards", [])
    shards.append((row_offset, loaded))
    if "quant_ready" in param.__dict__:  # rows staged again after the weight was complete: finalize decides
        shards.insert(0, (0, param.__dict__.pop("quant_ready")))
        return
    qtype = _repackable(param, shards)
    if qtype is not None:
        param.__dict__["quant_ready"] = QuantizedWeight(qtype, _joined(shards), param.shape[1],
                                                        param.__dict__.get("int8_activations", False))
        del param.__dict__["quant_shards"]


def _repackable(param: nn.Parameter, shards: list) -> int | None:
    """The one GGUF type of ``shards`` when they cover ``param``'s rows exactly, in order, and the
    kernel runs here; else None."""
    if any(isinstance(s[1], QuantizedWeight) for s in shards):
        return None
    shards.sort(key=lambda s: s[0])
    covered = sum(s[1].shape[0] for s in shards)
    contiguous = all(a[0] + a[1].shape[0] == b[0] for a, b in zip(shards, shards[1:])) and shards[0][0] == 0
    qtypes = {s[1].qtype for s in shards}
    if len(qtypes) == 1 and covered == param.shape[0] and contiguous and kernel_available():
        return qtypes.pop()
    return None


def _row_groups(param: nn.Parameter, shards: list):
    """Shards covering ``param``'s rows in order, of several types: one ``QuantizedWeight`` per run of one type
    (layers/quant_groups.py); None where they do not cover the rows or the kernel does not run here."""
    from pagedllm.model.layers.quant_groups import QuantizedRowGroups

    if any(isinstance(s[1], QuantizedWeight) for s in shards) or not shards or not kernel_available():
        return None
    shards.sort(key=lambda s: s[0])
    contiguous = shards[0][0] == 0 and all(a[0] + a[1].shape[0] == b[0] for a, b in zip(shards, shards[1:]))
    if not contiguous or sum(s[1].shape[0] for s in shards) != param.shape[0]:
        return None
    runs: list[list] = []
    for shard in shards:
        if runs and runs[-1][0][1].qtype == shard[1].qtype:
            runs[-1].append(shard)
        else:
            runs.append([shard])
    int8 = param.__dict__.get("int8_activations", False)
    return QuantizedRowGroups([QuantizedWeight(run[0][1].qtype, _joined(run), param.shape[1], int8) for run in runs])


def _joined(shards: list) -> torch.Tensor:
    return torch.cat([s[1].raw for s in shards]) if len(shards) > 1 else shards[0][1].raw


def mark_int8_activations(param: nn.Parameter) -> None:
    """Have ``stage`` build ``param``'s K-quant weight in the int8-activation layout (``kquant.py``)."""
    param.__dict__["int8_activations"] = True


def finalize(param: nn.Parameter) -> QuantizedWeight | None:
    """The staged shards of ``param`` repacked into one ``QuantizedWeight`` (the float parameter
    emptied to ``[out, 0]``); None when nothing was staged. Shards of mixed types, rows also loaded
    as floats, or no kernel here: the staged rows are dequantized into the float parameter."""
    shards = param.__dict__.pop("quant_shards", None)
    target = param.__dict__.pop("convert_to", None)
    ready = param.__dict__.pop("quant_ready", None)
    rows = param.shape[0]
    if ready is not None:  # repacked by ``stage`` as its last shard came
        param.data = torch.empty(rows, 0)
        param.quant = ready
        return ready
    if not shards:
        if target is not None and getattr(param, "quant", None) is None:
            return convert(param, *target)
        return getattr(param, "quant", None)  # e.g. a tied LM head: the embedding finalized it
    if shards[0][0] == 0 and isinstance(shards[0][1], QuantizedWeight):  # complete, then staged again
        whole = shards.pop(0)[1]
        logger.warning("quantized weight %s staged twice: its rows dequantized to float32", tuple(param.shape))
        param.data.copy_(whole.rows(torch.arange(rows)))
    qtype = _repackable(param, shards)
    if qtype is not None:
        quant = QuantizedWeight(qtype, _joined(shards), param.shape[1], param.__dict__.get("int8_activations", False))
        param.data = torch.empty(rows, 0)
        param.quant = quant
        return quant
    grouped = _row_groups(param, shards)
    if grouped is not None:
        param.data = torch.empty(rows, 0)
        param.quant = grouped
        return grouped
    covered = sum(s[1].shape[0] for s in shards)
    qtypes = {s[1].qtype for s in shards}
    reason = "the compiled kernel is unavailable" if len(qtypes) == 1 and covered == rows else "mixed shard types"
    logger.warning("quantized weight %s dequantized to float32 (%s)", tuple(param.shape), reason)
    for offset, shard in shards:
        param.data.narrow(0, offset, shard.shape[0]).copy_(shard.materialize())
    return None


# ---------------------------------------------------------------------------------------------
# Float checkpoints (safetensors) kept as bf16 or int8 (csrc/bf16_gemm.h, the Q8_0 kernel)

WEIGHT_FORMATS = ("auto", "int8", "bf16", "float32")
"""``--quantization`` for float weights: auto keeps a bf16 checkpoint's weights bf16 (else float32);
int8 quantizes them at load to Q8_0 (int8 with one fp16 scale per 32 weights of a row, finer than
per-channel, 8.5 bits a weight); bf16 rounds float32 weights to bf16; float32 widens everything."""


def plan(quantization: str, checkpoint_bf16: bool) -> tuple[int, bool] | None:
    """``(qtype, lossless_only)`` to ``mark`` the float weights with, or None to keep them float32."""
    if quantization not in WEIGHT_FORMATS:
        raise ValueError(f"quantization must be one of {', '.join(WEIGHT_FORMATS)}, got {quantization!r}")
    if quantization == "float32" or (quantization == "auto" and not checkpoint_bf16):
        return None
    what = "bf16 checkpoint" if quantization == "auto" else f"--quantization {quantization}"
    if not kernel_available():
        from pagedllm.model.attention import cpu_op

        logger.warning("%s: weights widened to float32 at load (the compiled kernel is unavailable: %s)", what,
                       cpu_op.unavailable_reason() or "no AVX2 + FMA + F16C")
        return None
    if quantization == "auto":
        logger.info("bf16 checkpoint: weights kept in bf16, widened in registers and accumulated in float32 "
                    "(--quantization float32 widens them at load instead)")
    return {"int8": (Q8_0, False), "bf16": (BF16, False), "auto": (BF16, True)}[quantization]


def mark(param: nn.Parameter, qtype: int, lossless_only: bool) -> None:
    """Have ``finalize`` convert ``param``'s float rows to ``qtype`` (BF16 or Q8_0) when no GGUF rows
    were staged for it (only weights whose layers call ``finalize`` are converted)."""
    param.__dict__["convert_to"] = (qtype, lossless_only)


def convert(param: nn.Parameter, qtype: int, lossless_only: bool = False) -> QuantizedWeight | None:
    """``param``'s float32 rows ``[n, K]`` as a ``QuantizedWeight`` (BF16: rounded to nearest even, as
    ``Tensor.to``; Q8_0: gguf's quantizer), the float parameter emptied to ``[n, 0]``. None, the
    parameter left as it is, where K is not a multiple of 32 or, with ``lossless_only``, where bf16
    would round a value (a float32 tensor in a bf16 checkpoint)."""
    w = param.data
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] % BLOCK_K or not w.numel():
        logger.info("weight %s kept float32 (%s needs float32 CPU rows of a multiple of %d)", tuple(w.shape),
                    NAMES[qtype], BLOCK_K)
        return None
    if qtype == BF16:
        rounded = w.to(torch.bfloat16)
        if lossless_only and not torch.equal(rounded.float(), w):
            logger.info("weight %s kept float32 (its values are not all bf16)", tuple(w.shape))
            return None
        raw = rounded.contiguous().view(torch.uint8)  # [n, 2K]
    else:
        from gguf.quants import quantize

        raw = torch.from_numpy(quantize(w.contiguous().numpy(), Q8_0))  # [n, K/32 * 34]
    quant = QuantizedWeight(qtype, raw, w.shape[1])
    param.data = torch.empty(w.shape[0], 0)
    param.quant = quant
    return quant
