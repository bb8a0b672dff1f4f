"""GGUF IQ4_NL weights held at their file's size for the int8-activation kernel (``csrc/quant_gemm_int8*``, whose
header has the layout): per 32 weights an fp16 d and 16 bytes of 4-bit indices into llama.cpp's fixed non-linear
table ``KVALUES``, w = d * KVALUES[index]. The kernel looks the int8 values up with one byte shuffle per 16
indices and multiplies them as Q8_0's.

``repack`` turns the GGUF rows into the kernel's panels, Q4_0's int8 layout (the bytes reordered, nothing
widened); ``rows`` reads rows back as float32, bit for bit gguf's numpy ``dequantize``::

    GGUF block (one row, 32 weights)    kernel panel block (16 rows)
    IQ4_NL  d qs(16)          18   ->   d x16, nibbles [group g: 4][row r: 16][byte i: 4] = qs[4 g + i]   288 = 16 x 18

The exact mode (float activations) expands them to the K-quants' QX panels instead (``quant_layout.expand_k_quant``).
"""

from __future__ import annotations

import numpy as np
import torch

IQ4_NL = 20  # GGMLQuantizationType value
KERNEL_TYPE = {IQ4_NL: 130}
"""The kernel's type (csrc/quant_gemm_int8.h) by GGUF type."""
GGUF_TYPE = {v: k for k, v in KERNEL_TYPE.items()}
GGUF_BYTES = {IQ4_NL: 18}
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
"""llama.cpp's kvalues_iq4nl: the value of each 4-bit index."""
PANEL_ROWS = 16
_CHUNK_PANELS = 64


def _fill(out: np.ndarray, rows: np.ndarray) -> None:
    """GGUF rows ``rows [16 p, nb, 18]`` into panels ``out [p, nb, 288]``."""
    p, nb, _ = out.shape
    blocks = rows.reshape(p, PANEL_ROWS, nb, 18).transpose(0, 2, 1, 3)  # [p, nb, 16 rows, 18]
    out[..., :32] = blocks[..., :2].reshape(p, nb, 32)
    out[..., 32:] = blocks[..., 2:].reshape(p, nb, PANEL_ROWS, 4, 4).transpose(0, 1, 3, 2, 4).reshape(p, nb, 256)


def repack(qtype: int, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows ``[n, K/32 * 18]`` -> the kernel's panels ``[ceil(n/16), K/32, 288]`` (rows past n are zero
    blocks: they compute zeros the op never stores)."""
    assert qtype == IQ4_NL
    n = raw.shape[0]
    nb = raw.shape[1] // 18
    num_panels = -(-n // PANEL_ROWS)
    source = raw.numpy().reshape(n, nb, 18)
    packed = np.empty((num_panels, nb, 288), dtype=np.uint8)
    for p0 in range(0, num_panels, _CHUNK_PANELS):
        p1 = min(num_panels, p0 + _CHUNK_PANELS)
        chunk = source[p0 * PANEL_ROWS : p1 * PANEL_ROWS]
        if chunk.shape[0] < (p1 - p0) * PANEL_ROWS:  # the last panel's missing rows: zero blocks
            chunk = np.concatenate([chunk, np.zeros(((p1 - p0) * PANEL_ROWS - chunk.shape[0], nb, 18), np.uint8)])
        _fill(packed[p0:p1], chunk)
    return torch.from_numpy(packed)


def rows(kernel_type: int, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a repacked weight as float32 ``[len(ids), K]``: d * KVALUES[index], as gguf's numpy
    dequantize forms it."""
    assert kernel_type in GGUF_TYPE
    a = packed.numpy()
    ids = ids.reshape(-1).numpy()
    panel, lane = ids // PANEL_ROWS, ids % PANEL_ROWS
    t, nb = ids.shape[0], a.shape[1]
    d = np.ascontiguousarray(a[:, :, :32].reshape(-1, nb, PANEL_ROWS, 2)[panel, :, lane, :]).view(np.float16)
    nib = a[:, :, 32:].reshape(-1, nb, 4, PANEL_ROWS, 4)[panel, :, :, lane, :].reshape(t, nb, 16)  # k = 4 g + i
    index = np.concatenate([nib & np.uint8(15), nib >> np.uint8(4)], axis=2)  # [T, nb, 32]
    values = d.astype(np.float32).reshape(t, nb, 1) * KVALUES[index].astype(np.float32)
    return torch.from_numpy(values.reshape(t, nb * 32))


def expand(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks ``[num, 18]`` -> ``(q int8 [num, 32], d float32 [num, 1])`` with w = d * q."""
    qs = blocks[:, 2:]
    index = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=1)
    return KVALUES[index], blocks[:, :2].copy().view(np.float16).astype(np.float32)
