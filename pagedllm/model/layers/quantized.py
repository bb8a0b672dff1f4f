"""GGUF-quantized weights kept quantized in memory (Q8_0, Q4_0, Q4_1), multiplied by the compiled
kernel of ``csrc/quant_gemm*.cpp``.

The loader hands a linear's weight loader a ``QuantTensor`` (the GGUF rows, still quantized)
instead of a float tensor; the loader stores it with ``stage`` (on the parameter, at the row
offset a fused QKV / gate-up shard goes to), and ``finalize`` (from
``process_weights_after_loading``) repacks the staged rows once into the kernel's layout::

    GGUF, row-major:     row n = K/32 blocks [d (m) q-bytes]   (Q8: byte j = q_j; Q4: q_j | q_(j+16) << 4)
    repacked, panels:    panel p = rows 16p..16p+15; per K-block:
                         [d x16][m x16 (Q4_1)][byte 0 of 16 rows][byte 1 of 16 rows]...

so one k-step of 16 output rows is one contiguous vector load, widened and scaled in registers
(``csrc/quant_gemm.h``). The repacked weight is the GGUF size exactly; no float32 copy is kept,
and the float parameter is left empty (``[out, 0]``). The dequantized values are bit for bit
gguf's numpy ones, so the product equals the dequantize-then-float32 path up to summation order.

Tensor parallelism narrows a ``QuantTensor`` like a float tensor: rows freely, columns (a row-
parallel shard) in whole 32-wide blocks. Embedding tables stay quantized too: a lookup
dequantizes only the looked-up rows (``dequantize_rows``, plain torch); a tied LM head multiplies
by the embedding's ``QuantizedWeight`` (found on the shared parameter).

Where the compiled op is unavailable (not built, ``PAGEDLLM_DISABLE_CPU_OP=1``, no AVX2 + FMA +
F16C), ``finalize`` dequantizes the staged rows into the float parameter instead, with a log line:
the model then runs today's float32 path, just as ``--gguf-dequantize`` would.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGMLQuantizationType values
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
GGUF_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
"""Bytes of one 32-weight block in the GGUF file."""
PACKED_BLOCK_BYTES = {Q4_0: 32 + 256, Q4_1: 64 + 256, Q8_0: 32 + 512}
"""Bytes of one K-block of a 16-row panel once repacked (csrc/quant_gemm.h)."""
BLOCK_K = 32
PANEL_ROWS = 16
SUPPORTED = frozenset(NAMES)
ISA_ENV = "PAGEDLLM_CPU_GEMM_ISA"  # the float32 GEMM's switch; forces this kernel's ISA too
ISA_CODES = {"": 0, "best": 0, "avx2": 1, "avx512": 2}


class QuantTensor:
    """A GGUF weight ``[rows, K]`` still quantized: ``raw`` is ``[rows, K / 32 * block bytes]`` uint8.
    ``narrow`` keeps it quantized (columns in whole blocks); ``materialize`` dequantizes."""

    __slots__ = ("qtype", "raw", "shape")

    def __init__(self, qtype: int, raw: torch.Tensor, k: int) -> None:
        assert qtype in SUPPORTED and raw.dtype == torch.uint8 and raw.dim() == 2
        assert raw.shape[1] * BLOCK_K == k * GGUF_BLOCK_BYTES[qtype], (raw.shape, k)
        self.qtype, self.raw, self.shape = qtype, raw, torch.Size((raw.shape[0], k))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor:
        if dim == 0:
            return QuantTensor(self.qtype, self.raw.narrow(0, start, length), self.shape[1])
        if start % BLOCK_K or length % BLOCK_K:
            raise ValueError(f"a {NAMES[self.qtype]} weight splits its columns in blocks of {BLOCK_K}; "
                             f"columns [{start}, {start + length}) cut a block")
        bb = GGUF_BLOCK_BYTES[self.qtype]
        return QuantTensor(self.qtype, self.raw.narrow(1, start // BLOCK_K * bb, length // BLOCK_K * bb), length)

    def materialize(self) -> torch.Tensor:
        from gguf.quants import dequantize

        array = dequantize(self.raw.contiguous().numpy(), self.qtype)  # [rows, K] float32
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(self.shape))


def repack(qtype: int, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows ``[n, K/32 * block bytes]`` -> the kernel's panels ``[ceil(n/16), K/32, packed
    block bytes]`` (rows past n are zero blocks: they compute zeros the op never stores). In numpy:
    torch's byte-wise strided copies ran ~100x slower here (0.2 s for one 1536 x 576 weight)."""
    n = raw.shape[0]
    bb = GGUF_BLOCK_BYTES[qtype]
    nb = raw.shape[1] // bb
    num_panels = -(-n // PANEL_ROWS)
    num_scales = 2 if qtype == Q4_1 else 1
    blocks = np.zeros((num_panels * PANEL_ROWS, nb, bb), dtype=np.uint8)
    blocks[:n] = raw.numpy().reshape(n, nb, bb)
    blocks = blocks.reshape(num_panels, PANEL_ROWS, nb, bb)
    scales = np.ascontiguousarray(blocks[..., : 2 * num_scales]).view(np.uint16)  # [P, 16 rows, nb, d (m)]
    scales = np.ascontiguousarray(scales.transpose(0, 2, 3, 1)).reshape(num_panels, nb, -1).view(np.uint8)  # [P, nb, d x16 (m x16)]
    q = blocks[..., 2 * num_scales :].transpose(0, 2, 3, 1).reshape(num_panels, nb, -1)  # [P, nb, byte j x 16 rows]
    packed = np.concatenate([scales, q], axis=-1)
    assert packed.shape[-1] == PACKED_BLOCK_BYTES[qtype]
    return torch.from_numpy(packed)


def dequantize_rows(qtype: int, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a repacked weight as float32 ``[len(ids), K]`` (values bit for bit gguf's)."""
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
    name = os.environ.get(ISA_ENV, "").lower()
    if name not in ISA_CODES:
        raise ValueError(f"{ISA_ENV}={name!r}: expected one of avx512, avx2, best")
    return ISA_CODES[name]


def kernel_available() -> bool:
    """Whether the compiled quantized kernel runs here (library loaded, an ISA it supports)."""
    from pagedllm.model.attention import cpu_op

    return (cpu_op.load() and hasattr(torch.ops.pagedllm, "quant_gemm_isa")
            and int(torch.ops.pagedllm.quant_gemm_isa(kernel_isa())) != 0)


class QuantizedWeight:
    """One repacked ``[n, k]`` weight and its product ``x W^T (+ bias)``."""

    __slots__ = ("qtype", "packed", "n", "k", "isa", "_op")

    def __init__(self, qtype: int, raw: torch.Tensor, k: int) -> None:
        self.qtype, self.n, self.k = qtype, raw.shape[0], k
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
            y = self._op(x.reshape(-1, self.k).float().contiguous(), self.packed, self.qtype, self.n, bias, self.isa)
            return y.view(*shape[:-1], self.n)
        return self._op(x, self.packed, self.qtype, self.n, bias, self.isa)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized to float32 ``[len(ids), k]``."""
        return dequantize_rows(self.qtype, self.packed, ids)


def stage(param: nn.Parameter, row_offset: int, loaded: QuantTensor) -> None:
    """Keep ``loaded`` (rows ``[row_offset, row_offset + rows)`` of ``param``) for ``finalize``."""
    if loaded.shape[1] != param.shape[1]:
        raise ValueError(f"a quantized shard of {loaded.shape[1]} columns for a weight of {param.shape[1]}")
    shards = param.__dict__.setdefault("quant_shards", [])
    shards.append((row_offset, loaded))


def finalize(param: nn.Parameter) -> QuantizedWeight | None:
    """The staged shards of ``param`` repacked into one ``QuantizedWeight`` (the float parameter
    emptied to ``[out, 0]``); None when nothing was staged. Shards of mixed types, rows also loaded
    as floats, or no kernel here: the staged rows are dequantized into the float parameter."""
    shards = param.__dict__.pop("quant_shards", None)
    if not shards:
        return getattr(param, "quant", None)  # e.g. a tied LM head: the embedding finalized it
    shards.sort(key=lambda s: s[0])
    rows = param.shape[0]
    covered = sum(s[1].shape[0] for s in shards)
    contiguous = all(a[0] + a[1].shape[0] == b[0] for a, b in zip(shards, shards[1:])) and shards[0][0] == 0
    qtypes = {s[1].qtype for s in shards}
    if len(qtypes) == 1 and covered == rows and contiguous and kernel_available():
        qtype = qtypes.pop()
        raw = torch.cat([s[1].raw for s in shards]) if len(shards) > 1 else shards[0][1].raw
        quant = QuantizedWeight(qtype, raw, param.shape[1])
        param.data = torch.empty(rows, 0)
        param.quant = quant
        return quant
    reason = "the compiled kernel is unavailable" if len(qtypes) == 1 and covered == rows else "mixed shard types"
    logger.warning("quantized weight %s dequantized to float32 (%s)", tuple(param.shape), reason)
    for offset, shard in shards:
        param.data.narrow(0, offset, shard.shape[0]).copy_(shard.materialize())
    return None
