"""GGUF Q5_0 / Q5_1 weights held at their file's size for the int8-activation kernel (``csrc/quant_gemm_int8*``,
whose header has the layout). llama-quantize writes these 32-weight types where a K-quant's 256-wide blocks do
not fit a row (e.g. 896-wide rows: Q5_0 for Q4_K, Q5_1 for Q5_K), so a Q4_K_M file can hold them too.

``repack`` turns the GGUF rows into the kernel's panels one chunk of rows at a time; ``rows`` reads rows back as
float32, bit for bit gguf's numpy ``dequantize`` (the reference of the compiled lookup, ``quant_rows_cpu``, and
the path without it)::

    GGUF block (one row, 32 weights)        kernel panel block (16 rows)
    Q5_0  d qh(4) qs(16)            22  ->  d x16,        fifth bits (a dword a row), nibbles   352 = 16 x 22
    Q5_1  d m qh(4) qs(16)          24  ->  d x16, m x16, fifth bits,                nibbles   384 = 16 x 24

    nibbles:      [group g: 4][row r: 16][byte i: 4] = qs[4 g + i]   (low nibble k = 4 g + i, high k + 16)
    fifth bits:   byte i of row r's dword: bit g = qh bit 4 g + i + 16, bit 4 + g = qh bit 4 g + i

Used when the model runs with int8 activations: ``QuantizedWeight`` takes this layout at construction; the
exact mode (float activations) expands them to the K-quants' QX panels instead (``quant_layout.expand_k_quant``).
"""

from __future__ import annotations

import numpy as np
import torch

Q5_0, Q5_1 = 6, 7  # GGMLQuantizationType values
KERNEL_TYPE = {Q5_0: 116, Q5_1: 117}
"""The kernel's types (csrc/quant_gemm_int8.h) by GGUF type."""
GGUF_TYPE = {v: k for k, v in KERNEL_TYPE.items()}
GGUF_BYTES = {Q5_0: 22, Q5_1: 24}
"""Bytes of one 32-weight GGUF block (one row's)."""
BLOCK_K = 32
PANEL_ROWS = 16
_CHUNK_PANELS = 64  # panels repacked at once: 1024 rows


def unpack(qtype: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks ``[num, bytes]`` -> ``(q uint8 0..31 [num, 32], d fp16 bytes [num, 2], m fp16 bytes or None)``."""
    scale_bytes = 4 if qtype == Q5_1 else 2
    qh = np.ascontiguousarray(blocks[:, scale_bytes : scale_bytes + 4]).view("<u4")  # [num, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)  # [num, 32]: bit k of q[k]
    qs = blocks[:, scale_bytes + 4 :]
    q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=1) | (high << np.uint8(4))
    return q, blocks[:, 0:2], blocks[:, 2:4] if qtype == Q5_1 else None


def _fill(qtype: int, out: np.ndarray, rows: np.ndarray) -> None:
    """GGUF rows ``rows [16 p, nb, bytes]`` into panels ``out [p, nb, panel bytes]``."""
    p, nb, _ = out.shape
    scale_bytes = 4 if qtype == Q5_1 else 2
    blocks = rows.reshape(p, PANEL_ROWS, nb, -1).transpose(0, 2, 1, 3)  # [p, nb, 16 rows, bytes]
    # d (and m): [p, nb, 16 rows, 2 scales, 2] -> [p, nb, 2 scales, 16 rows, 2]
    scales = blocks[..., :scale_bytes].reshape(p, nb, PANEL_ROWS, scale_bytes // 2, 2).transpose(0, 1, 3, 2, 4)
    out[..., : PANEL_ROWS * scale_bytes] = scales.reshape(p, nb, -1)
    high_at = PANEL_ROWS * scale_bytes
    qh = np.ascontiguousarray(blocks[..., scale_bytes : scale_bytes + 4]).view("<u4")[..., 0]  # [p, nb, 16]
    bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)  # [p, nb, 16, k]
    low, high = bits[..., :16].reshape(p, nb, PANEL_ROWS, 4, 4), bits[..., 16:].reshape(p, nb, PANEL_ROWS, 4, 4)
    g = np.arange(4, dtype=np.uint8).reshape(4, 1)
    dword = np.bitwise_or.reduce((high << g) | (low << (g + np.uint8(4))), axis=3)  # [p, nb, 16 rows, byte i]
    out[..., high_at : high_at + 64] = dword.reshape(p, nb, 64)
    qs = blocks[..., scale_bytes + 4 :].reshape(p, nb, PANEL_ROWS, 4, 4).transpose(0, 1, 3, 2, 4)  # [.., g, r, i]
    out[..., high_at + 64 :] = qs.reshape(p, nb, 256)


def repack(qtype: int, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows ``[n, K/32 * bytes]`` -> the kernel's panels ``[ceil(n/16), K/32, 16 * bytes]`` (rows past n are
    zero blocks: they compute zeros the op never stores)."""
    n = raw.shape[0]
    bb = GGUF_BYTES[qtype]
    nb = raw.shape[1] // bb
    num_panels = -(-n // PANEL_ROWS)
    source = raw.numpy().reshape(n, nb, bb)
    packed = np.empty((num_panels, nb, PANEL_ROWS * bb), dtype=np.uint8)
    for p0 in range(0, num_panels, _CHUNK_PANELS):
        p1 = min(num_panels, p0 + _CHUNK_PANELS)
        chunk = source[p0 * PANEL_ROWS : p1 * PANEL_ROWS]
        if chunk.shape[0] < (p1 - p0) * PANEL_ROWS:  # the last panel's missing rows: zero blocks
            chunk = np.concatenate([chunk, np.zeros(((p1 - p0) * PANEL_ROWS - chunk.shape[0], nb, bb), np.uint8)])
        _fill(qtype, packed[p0:p1], chunk)
    return torch.from_numpy(packed)


def rows(kernel_type: int, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a repacked weight as float32 ``[len(ids), K]``, formed as gguf's numpy dequantize forms
    them (Q5_0 d (q - 16), Q5_1 d q + m), so equal to it bit for bit."""
    qtype = GGUF_TYPE[kernel_type]
    a = packed.numpy()
    ids = ids.reshape(-1).numpy()
    panel, lane = ids // PANEL_ROWS, ids % PANEL_ROWS
    t, nb = ids.shape[0], a.shape[1]
    scale_bytes = 4 if qtype == Q5_1 else 2
    high_at = PANEL_ROWS * scale_bytes

    def lane_bytes(start: int, width: int, inner: int) -> np.ndarray:  # [T, nb, width / 16 / inner, inner]
        region = a[:, :, start : start + width].reshape(a.shape[0], nb, width // (PANEL_ROWS * inner), PANEL_ROWS,
                                                        inner)
        return region[panel, :, :, lane, :]

    def fp16(start: int) -> np.ndarray:  # [T, nb, 1] float32
        return np.ascontiguousarray(lane_bytes(start, 32, 2)).view(np.float16).astype(np.float32).reshape(t, nb, 1)

    nib = lane_bytes(high_at + 64, 256, 4)  # [T, nb, g, i]
    dword = lane_bytes(high_at, 64, 4).reshape(t, nb, 1, 4)  # byte i
    g = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1)
    low = (nib & np.uint8(15)) | (((dword >> (g + np.uint8(4))) & np.uint8(1)) << np.uint8(4))
    high = (nib >> np.uint8(4)) | (((dword >> g) & np.uint8(1)) << np.uint8(4))
    q = np.concatenate([low.reshape(t, nb, 16), high.reshape(t, nb, 16)], axis=2)  # [T, nb, 32]
    if qtype == Q5_0:
        values = fp16(0) * (q.astype(np.int8) - np.int8(16)).astype(np.float32)
    else:
        values = fp16(0) * q.astype(np.float32) + fp16(32)
    return torch.from_numpy(values.reshape(t, nb * BLOCK_K))
