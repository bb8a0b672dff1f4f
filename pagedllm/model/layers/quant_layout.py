"""GGUF-quantized weights as bytes: the GGUF types, a weight still in its file's rows (``QuantTensor``), and the
compiled kernel's panel layouts they are repacked into once at load (numpy; no compiled op here)::

    GGUF, row-major:     row n = K/32 blocks [d (m) q-bytes]   (Q8: byte j = q_j; Q4: q_j | q_(j+16) << 4)
    repacked, panels:    panel p = rows 16p..16p+15; per K-block:
                         [d x16][m x16 (Q4_1)][byte 0 of 16 rows][byte 1 of 16 rows]...

so one k-step of 16 output rows is one contiguous vector load, widened and scaled in registers
(``csrc/quant_gemm.h``). The repacked weight is the GGUF size exactly. The dequantized values are bit for bit
gguf's numpy ones.

The K-quants (256-weight super-blocks, 6-bit sub-block scales) are expanded into the kernel's QX panels: per
16 weights a float32 scale ``d * sc`` and min ``-dmin * m`` (each product exact in float32, as gguf's numpy
forms it) and the 4-6 bit values as int8, at 12 bits a weight; so are Q5_0 / Q5_1 (scale d, min 0 or m) and
IQ4_NL (its table's values, scale d), whose file-size layouts are the int8-activation kernel's only (``q5.py``,
``iq4nl.py``). The int8-activation kernel reads the same
Q8_0 / Q4_0 / Q4_1 panels with each block's quant bytes reordered (``to_int8_layout``).

``layers/quant_weight.py`` multiplies by these panels; ``layers/quantized.py`` stages a layer's shards and
says what a load keeps quantized.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, BF16 = 2, 3, 6, 7, 8, 11, 12, 13, 14, 20, 30  # GGUF types
QX = 100  # the kernel's expanded layout for the K-quants (csrc/quant_gemm.h), no GGUF type
BF16_KERNEL = 101  # bfloat16 panels (csrc/bf16_gemm.h), no GGUF type
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K", IQ4_NL: "IQ4_NL", BF16: "BF16"}
GGUF_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q3_K: (256, 110),
               Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), IQ4_NL: (32, 18), BF16: (1, 2)}
"""(weights, bytes) of one block in the GGUF file."""
KERNEL_TYPE = {Q4_0: Q4_0, Q4_1: Q4_1, Q5_0: QX, Q5_1: QX, Q8_0: Q8_0, Q3_K: QX, Q4_K: QX, Q5_K: QX, Q6_K: QX,
               IQ4_NL: QX, BF16: BF16_KERNEL}
PACKED_BLOCK_BYTES = {Q4_0: 32 + 256, Q4_1: 64 + 256, Q8_0: 32 + 512, QX: 256 + 512, BF16_KERNEL: 1024}
"""Bytes of one K-block of a 16-row panel once repacked (csrc/quant_gemm.h), by kernel type."""
BLOCK_K = 32
PANEL_ROWS = 16
SUPPORTED = frozenset((Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL))
"""The GGUF types the GGUF loader keeps as they are (BF16 reaches the kernel from safetensors, ``convert``)."""
INT8_KERNEL_TYPE = {Q4_0: 112, Q4_1: 113, Q8_0: 118}
"""The int8-activation kernel's types (csrc/quant_gemm_int8.h) by kernel type: the same panels with
each block's quant bytes reordered (``to_int8_layout``)."""


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
    """GGUF K-quant (or Q5_0 / Q5_1) rows ``[n, K/256 * block bytes]`` -> ``(q int8 [n, K], scale, min
    float32 [n, K/16])`` with weight = q * scale + min, each term formed as gguf's numpy dequantize does."""
    from gguf.quants import Q4_K as GGUF_Q4_K

    n = raw.shape[0]
    blocks = raw.reshape(-1, GGUF_BLOCKS[qtype][1])  # [n * K/256, bytes]
    num = blocks.shape[0]
    if qtype == IQ4_NL:  # d * table value, per 32 weights
        from pagedllm.model.layers.iq4nl import expand

        q, d = expand(blocks)
        scale = np.repeat(d, 2, axis=1)
        minv = np.zeros_like(scale)
    elif qtype in (Q5_0, Q5_1):  # d (q - 16) or d q + m, per 32 weights
        from pagedllm.model.layers.q5 import unpack

        q5, d, m = unpack(qtype, blocks)
        scale = np.repeat(d.copy().view(np.float16).astype(np.float32), 2, axis=1)  # [num, 2 halves]
        minv = np.zeros_like(scale) if m is None else np.repeat(m.copy().view(np.float16).astype(np.float32), 2, axis=1)
        q = q5.astype(np.int8) - np.int8(16 if qtype == Q5_0 else 0)
    elif qtype in (Q4_K, Q5_K):
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
    elif qtype == Q3_K:
        from pagedllm.model.layers.kquant import _unpack

        q4, d, sc = _unpack(Q3_K, blocks)  # q + 4 (0..7), d bytes, sc - 32 (int8 bytes)
        scale = sc.view(np.int8).astype(np.float32) * d.copy().view(np.float16).astype(np.float32)  # [num, 16]
        minv = np.zeros_like(scale)
        q = q4.astype(np.int8) - np.int8(4)
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
