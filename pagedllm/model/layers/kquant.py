"""GGUF K-quant weights (Q3_K, Q4_K, Q5_K, Q6_K) held at their file's size for the int8-activation kernel
(``csrc/quant_gemm_kq*``; the layout diagram is in ``csrc/quant_gemm_kq.h``).

``repack`` turns the GGUF rows into the kernel's panels in one pass over row chunks (the 4-6 bit
values are unpacked one chunk of rows at a time, never the whole weight: a load's peak stays the
repacked weight plus one chunk); ``rows`` reads rows back as float32, bit for bit gguf's numpy
``dequantize`` (the embedding lookup where the compiled one, ``quant_rows_cpu``, is missing; a tied
LM head's table is this same weight):

    GGUF super-block (one row, 256 weights)    kernel panel super-block (16 rows, 256 weights each)
    Q4_K  d dmin sc/m(12, 6-bit) qs(128)  144  ->  d x16, dmin x16, sc 8 x16, m 8 x16, nibbles   148 x16
    Q5_K  d dmin sc/m(12) qh(32) qs(128)  176  ->  ... as Q4_K, 5th bits (2 quads), nibbles     180 x16
    Q6_K  ql(128) qh(64) sc(16) d          210  ->  d x16, sc 16 x16, 5th-6th bits (4 pairs), nibbles  210 x16
    Q3_K  hmask(32) qs(64) sc(12) d        110  ->  d x16, sc - 32 16 x16, 3rd bits (4 pairs), 2-bit fields  114 x16

Used when the model runs with int8 activations (``--quant-activations int8``): ``QuantizedWeight``
takes this layout at construction, so the 12-bit expansion the float-activation path uses (QX, in
``quantized.py``) is never made.
"""

from __future__ import annotations

import numpy as np
import torch

Q3_K, Q4_K, Q5_K, Q6_K = 11, 12, 13, 14  # GGMLQuantizationType values
KERNEL_TYPE = {Q3_K: 121, Q4_K: 122, Q5_K: 123, Q6_K: 124}
"""The kernel's types (csrc/quant_gemm_kq.h) by GGUF type."""
GGUF_TYPE = {v: k for k, v in KERNEL_TYPE.items()}
GGUF_BYTES = {Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
"""Bytes of one 256-weight GGUF super-block (one row's)."""
PANEL_BYTES = {Q3_K: 1824, Q4_K: 2368, Q5_K: 2880, Q6_K: 3360}
"""Bytes of one 16-row panel's super-block."""
SUPER_K = 256
PANEL_ROWS = 16
_CHUNK_PANELS = 16  # panels unpacked at once: 256 rows, a few MB of values at K = 8192


def _offsets(qtype: int) -> dict[str, int]:
    """Byte offsets inside a panel's super-block (csrc/quant_gemm_kq_kernel.h's KQOffsets)."""
    if qtype == Q6_K:
        return {"scales": 32, "high": 288, "nibbles": 1312}
    if qtype == Q3_K:  # "nibbles": the 2-bit fields
        return {"scales": 32, "high": 288, "nibbles": 800}
    return {"scales": 64, "mins": 192, "high": 320, "nibbles": 320 if qtype == Q4_K else 832}


def _unpack(qtype: int, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """GGUF super-blocks ``[num, bytes]`` -> ``(q uint8 [num, 256], d fp16 bytes [num, 2], ...)``:
    Q4_K / Q5_K add dmin bytes and the 8 scales and mins (uint8); Q6_K its 16 int8 scales (as bytes); Q3_K its
    16 scales - 32 (int8, as bytes) and q + 4 (0..7) for gguf's q."""
    from gguf.quants import Q4_K as GGUF_Q4_K

    num = blocks.shape[0]
    if qtype == Q3_K:  # q = the 2 low bits + 4 x the hmask bit (0..7; gguf's q + 4), scales - 32 as int8
        ql = blocks[:, 32:96].reshape(num, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh = blocks[:, :32].reshape(num, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = (ql & np.uint8(3)).reshape(num, SUPER_K) | ((qh & np.uint8(1)).reshape(num, SUPER_K) << np.uint8(2))
        low = blocks[:, 96:104].reshape(num, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        high = blocks[:, 104:108].reshape(num, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
        sc = (low & np.uint8(15)).reshape(num, 16) | ((high & np.uint8(3)).reshape(num, 16) << np.uint8(4))
        return q, blocks[:, 108:110], sc - np.uint8(32)  # uint8 wrap-around: the int8 bytes of sc - 32
    if qtype == Q6_K:
        ql = blocks[:, :128].reshape(num, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(num, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = (ql & np.uint8(15)).reshape(num, 8, 32) | ((qh & np.uint8(3)).reshape(num, 8, 32) << np.uint8(4))
        return q.reshape(num, SUPER_K), blocks[:, 208:210], blocks[:, 192:208]
    qs = blocks[:, -128:].reshape(num, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(15)).reshape(num, 8, 32)
    if qtype == Q5_K:
        qh = blocks[:, 16:48].reshape(num, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = q | ((qh & np.uint8(1)).reshape(num, 8, 32) << np.uint8(4))
    sc, m = GGUF_Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return q.reshape(num, SUPER_K), blocks[:, 0:2], blocks[:, 2:4], sc.astype(np.uint8), m.astype(np.uint8)


def _to_panels(a: np.ndarray, p: int, nsb: int) -> np.ndarray:
    """Per-row data ``[16 p rows, nsb, *inner]`` -> ``[p, nsb, *inner[:-1], 16 rows, inner[-1]]``."""
    inner = a.shape[2:]
    a = a.reshape(p, PANEL_ROWS, nsb, *inner)
    order = (0, 2) + tuple(range(3, 3 + len(inner) - 1)) + (1, 2 + len(inner))
    return a.transpose(order)


def _fill(qtype: int, out: np.ndarray, blocks: np.ndarray) -> None:
    """GGUF rows ``blocks [16 p, nsb, bytes]`` into panels ``out [p, nsb, panel bytes]``."""
    p, nsb, _ = out.shape
    q, d, *rest = _unpack(qtype, blocks.reshape(-1, GGUF_BYTES[qtype]))
    off = _offsets(qtype)
    rows = p * PANEL_ROWS

    def put(start: int, part: np.ndarray) -> None:  # part [16 p rows, nsb, ...]: its panel form at start
        panels = _to_panels(part.reshape(rows, nsb, *part.shape[1:]), p, nsb)
        width = int(np.prod(panels.shape[2:]))
        np.reshape(out[:, :, start : start + width], panels.shape, copy=False)[...] = panels

    put(0, d.reshape(-1, 1, 2))
    if qtype == Q3_K:  # per 32-block b: [g: 2][row][i] = sum_j (q[32 b + 8 j + 4 g + i] & 3) << 2 j
        put(off["scales"], rest[0].reshape(-1, 16, 1))
        fields = q.reshape(-1, 8, 4, 2, 4) & np.uint8(3)
        put(off["nibbles"], np.bitwise_or.reduce(fields << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1),
                                                 axis=2))
        bits = (q.reshape(-1, 4, 2, 4, 2, 4) >> np.uint8(2)) & np.uint8(1)  # pair t, block u: bit 4 u + j
        shifts = (4 * np.arange(2).reshape(2, 1) + np.arange(4).reshape(1, 4)).astype(np.uint8)
        put(off["high"], np.bitwise_or.reduce(bits << shifts.reshape(1, 1, 2, 4, 1, 1), axis=(2, 3)))
        return
    if qtype == Q6_K:
        put(off["scales"], rest[0].reshape(-1, 16, 1))
    else:
        put(32, rest[0].reshape(-1, 1, 2))  # dmin
        put(off["scales"], rest[1].reshape(-1, 8, 1))
        put(off["mins"], rest[2].reshape(-1, 8, 1))
    # per 32-block b: [g][row][i] = q[32 b + 4 g + i] | q[32 b + 16 + 4 g + i] << 4
    halves = q.reshape(-1, 8, 2, 4, 4)
    put(off["nibbles"], (halves[:, :, 0] & np.uint8(15)) | ((halves[:, :, 1] & np.uint8(15)) << np.uint8(4)))
    if qtype == Q5_K:  # quad t, block u = b % 4: bit 2 u + half is bit 4 of q
        bits = (q.reshape(-1, 2, 4, 2, 4, 4) >> np.uint8(4)) & np.uint8(1)
        shifts = (2 * np.arange(4).reshape(4, 1) + np.arange(2).reshape(1, 2)).astype(np.uint8)
        put(off["high"], np.bitwise_or.reduce(bits << shifts.reshape(1, 1, 4, 2, 1, 1), axis=(2, 3)))
    elif qtype == Q6_K:  # pair t, block u = b % 2: bits 4 u + 2 half .. + 1 are bits 4-5 of q
        bits = q.reshape(-1, 4, 2, 2, 4, 4) >> np.uint8(4)
        shifts = (4 * np.arange(2).reshape(2, 1) + 2 * np.arange(2).reshape(1, 2)).astype(np.uint8)
        put(off["high"], np.bitwise_or.reduce(bits << shifts.reshape(1, 1, 2, 2, 1, 1), axis=(2, 3)))


def repack(qtype: int, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows ``[n, K/256 * bytes]`` -> the kernel's panels ``[ceil(n/16), K/256, panel bytes]`` (rows
    past n are zero blocks: they compute zeros the op never stores)."""
    n = raw.shape[0]
    bb = GGUF_BYTES[qtype]
    nsb = raw.shape[1] // bb
    num_panels = -(-n // PANEL_ROWS)
    source = raw.numpy().reshape(n, nsb, bb)
    packed = np.empty((num_panels, nsb, PANEL_BYTES[qtype]), dtype=np.uint8)
    for p0 in range(0, num_panels, _CHUNK_PANELS):
        p1 = min(num_panels, p0 + _CHUNK_PANELS)
        chunk = source[p0 * PANEL_ROWS : p1 * PANEL_ROWS]
        if chunk.shape[0] < (p1 - p0) * PANEL_ROWS:  # the last panel's missing rows: zero blocks
            chunk = np.concatenate([chunk, np.zeros(((p1 - p0) * PANEL_ROWS - chunk.shape[0], nsb, bb), np.uint8)])
        _fill(qtype, packed[p0:p1], chunk)
    return torch.from_numpy(packed)


def rows(kernel_type: int, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a repacked weight as float32 ``[len(ids), K]``, formed as gguf's numpy
    dequantize forms them ((d sc) q - dmin m; Q6_K (d sc)(q - 32); Q3_K (d sc)(q - 4)), so equal to it bit for bit: the
    reference of the compiled lookup (csrc/step_ops.cpp), and the path without it."""
    qtype = GGUF_TYPE[kernel_type]
    a = packed.numpy()
    ids = ids.reshape(-1).numpy()
    panel, lane = ids // PANEL_ROWS, ids % PANEL_ROWS
    t, nsb = ids.shape[0], a.shape[1]
    off = _offsets(qtype)

    def lane_bytes(start: int, width: int, inner: int) -> np.ndarray:  # [T, nsb, width / 16 / inner, inner]
        region = a[:, :, start : start + width].reshape(a.shape[0], nsb, width // (PANEL_ROWS * inner), PANEL_ROWS,
                                                        inner)
        return region[panel, :, :, lane, :]

    def fp16(start: int) -> np.ndarray:  # [T, nsb, 1, 1] float32
        return np.ascontiguousarray(lane_bytes(start, 32, 2)).view(np.float16).astype(np.float32)

    if qtype == Q3_K:  # k = 32 b + 8 j + 4 g + i
        low = lane_bytes(off["nibbles"], 1024, 4).reshape(t, nsb, 8, 1, 2, 4)
        q = (low >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1, 1)) & np.uint8(3)
        high = lane_bytes(off["high"], 512, 4).reshape(t, nsb, 4, 1, 1, 2, 4)
        shifts = (4 * np.arange(2).reshape(2, 1) + np.arange(4).reshape(1, 4)).astype(np.uint8)
        q = q.reshape(t, nsb, 4, 2, 4, 2, 4) | (((high >> shifts.reshape(1, 1, 1, 2, 4, 1, 1)) & np.uint8(1)) << 2)
        scales = np.ascontiguousarray(lane_bytes(off["scales"], 256, 1)).view(np.int8).astype(np.float32)
        dsc = fp16(0).reshape(t, nsb, 1, 1) * scales  # [T, nsb, 16, 1]
        values = (q.reshape(t, nsb, 16, 16).astype(np.int8) - np.int8(4)).astype(np.float32)
        return torch.from_numpy((dsc * values).reshape(t, nsb * SUPER_K))

    nib = lane_bytes(off["nibbles"], 2048, 4).reshape(t, nsb, 8, 1, 4, 4)
    q = np.concatenate([nib & np.uint8(15), nib >> np.uint8(4)], axis=3).reshape(t, nsb, 8, 32)
    if qtype == Q5_K:
        high = lane_bytes(off["high"], 512, 4).reshape(t, nsb, 2, 1, 1, 4, 4)
        shifts = (2 * np.arange(4).reshape(4, 1) + np.arange(2).reshape(1, 2)).astype(np.uint8)
        q = q | ((((high >> shifts.reshape(1, 1, 1, 4, 2, 1, 1)) & np.uint8(1)) << np.uint8(4))
                 .reshape(t, nsb, 8, 32))
    if qtype == Q6_K:
        high = lane_bytes(off["high"], 1024, 4).reshape(t, nsb, 4, 1, 1, 4, 4)
        shifts = (4 * np.arange(2).reshape(2, 1) + 2 * np.arange(2).reshape(1, 2)).astype(np.uint8)
        q = q | ((((high >> shifts.reshape(1, 1, 1, 2, 2, 1, 1)) & np.uint8(3)) << np.uint8(4))
                 .reshape(t, nsb, 8, 32))
        scales = np.ascontiguousarray(lane_bytes(off["scales"], 256, 1)).view(np.int8).astype(np.float32)
        dsc = fp16(0).reshape(t, nsb, 1, 1) * scales  # [T, nsb, 16, 1]
        values = (q.reshape(t, nsb, 16, 16).astype(np.int8) - np.int8(32)).astype(np.float32)
        return torch.from_numpy((dsc * values).reshape(t, nsb * SUPER_K))
    sc = lane_bytes(off["scales"], 128, 1).astype(np.float32)  # [T, nsb, 8, 1]
    m = lane_bytes(off["mins"], 128, 1).astype(np.float32)
    dsc = fp16(0).reshape(t, nsb, 1, 1) * sc
    dm = fp16(32).reshape(t, nsb, 1, 1) * m
    return torch.from_numpy((dsc * q.astype(np.float32) - dm).reshape(t, nsb * SUPER_K))

