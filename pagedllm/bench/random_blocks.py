"""Random quantized GGUF blocks, written directly, and llama.cpp's Q4_K_M and Q3_K_M choices of type per tensor.

Every type's blocks dequantize to weights of standard deviation ``WEIGHT_STD`` (0.02, Llama's initialization)
and mean ~0: the same bytes a quantizer would write for such weights, in seconds instead of numpy
quantization's minutes. The block scales are fixed per type (computed below from the codes' moments), the
codes and the K-quants' sub-block scales random::

    Q8_0  (34 B / 32)   d f16 | 32 int8 codes                    w = d * q
    Q4_0  (18 B / 32)   d f16 | 16 bytes, 4-bit codes in 1..15   w = d * (q - 8)
    Q5_0  (22 B / 32)   d f16 | 4 bytes of 5th bits | 16 bytes, low 4 bits; codes in 1..31   w = d * (q - 16)
    Q5_1  (24 B / 32)   d f16, m f16 | 5th bits | low 4 bits; codes in 0..31, m = -15.5 d   w = d * q + m
    Q4_K  (144 B / 256) d f16, dmin f16 | 12 bytes: 8 6-bit scales sc and mins m | 128 bytes, 4-bit codes
                        w = d * sc_j * q - dmin * m_j           (sub-block j of 32)
    Q5_K  (176 B / 256) as Q4_K, then 32 bytes of 5th bits | 128 bytes, 4-bit codes   (q 5 bits)
    Q6_K  (210 B / 256) 128 bytes low 4 bits | 64 bytes high 2 bits | 16 int8 scales | d f16
                        w = d * sc_j * (q - 32)                  (sub-block j of 16, q 6 bits)
    Q3_K  (110 B / 256) 32 bytes hmask | 64 bytes low 2 bits | 12 bytes: 16 6-bit scales | d f16
                        w = d * (sc_j - 32) * q                  (sub-block j of 16, q in -4..3)

Q4_K's 12 scale bytes hold 8 scales and 8 mins of 6 bits each in a packing under which every byte pattern is
valid (gguf's ``Q4_K.get_scale_min``: each value is 6 bits taken from fixed places), so they are random bytes:
each scale and min uniform in 0..63, independent. With dmin = 7.5 d the expected sub-block offset
``d * sc * 7.5 - dmin * m`` is 0 (Q5_K: dmin = 15.5 d, its scales and mins in 0..31, ``Q5_K_SCALE_MASK``). Q3_K's 12 scale bytes are random for the same reason
(each scale uniform in 0..63, so sc - 32 in -32..31), its codes too: its mean is E[sc - 32] E[q] d = 0.25 d, 0.6%
of the standard deviation. Q6_K's scales are uniform in -24..24 (both signs, as llama.cpp's quantizer
writes them), a range that keeps d a normal f16 (>= 2**-14) at this standard deviation.

``q4_k_m_type`` and ``q3_k_m_type`` are llama.cpp's ``llama_tensor_get_type_impl`` (src/llama-quant.cpp, llama.cpp
as vendored in llama-cpp-python 0.3.36) for ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` and ``_Q3_K_M``, the branches that reach a
llama or qwen3moe file.
"""

from __future__ import annotations

import numpy as np

WEIGHT_STD = 0.02
Q8_0, Q4_0, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K = "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K"
BLOCK = {Q8_0: (32, 34), Q4_0: (32, 18), Q5_0: (32, 22), Q5_1: (32, 24), Q3_K: (256, 110), Q4_K: (256, 144),
         Q5_K: (256, 176), Q6_K: (256, 210)}
"""(weights, bytes) of one block."""


def _uniform_moments(low: int, high: int) -> tuple[float, float]:
    """(mean, mean of squares) of an integer uniform on low..high."""
    values = np.arange(low, high + 1, dtype=np.float64)
    return float(values.mean()), float((values**2).mean())


Q5_K_SCALE_MASK = 0x5F
"""Q5_K's first 8 scale bytes ANDed with this: bit 5 of every 6-bit scale and min cleared (uniform in 0..31),
so that d is a normal f16 (with 0..63 and 5-bit codes it would be 3.8e-5, subnormal)."""


def _q4_k_scales(q_max: int = 15, sc_max: int = 63) -> tuple[float, float]:
    """(d, dmin) for Q4_K (Q5_K: ``q_max`` 31, ``sc_max`` 31): w = d * (sc * q - 7.5 * m) with sc, m uniform
    0..63 and q 0..15 independent, so E[w] = 0 and E[w^2] = d^2 (E[sc^2] E[q^2] - 2 * 7.5 E[sc] E[q] E[m] +
    7.5^2 E[m^2])."""
    sc_mean, sc_sq = _uniform_moments(0, sc_max)
    q_mean, q_sq = _uniform_moments(0, q_max)
    ratio = q_mean  # dmin / d, so that E[sc * q] = ratio * E[m] (E[m] = E[sc])
    second = sc_sq * q_sq - 2 * ratio * sc_mean * q_mean * sc_mean + ratio**2 * sc_sq
    d = WEIGHT_STD / np.sqrt(second)
    return d, ratio * d


Q6_K_SCALE_MAX = 24
"""Q6_K's int8 sub-block scales are uniform in -24..24: d is then 7.7e-5, a normal f16 (31 would make it
subnormal)."""


def _q6_k_scale() -> float:
    _, sc_sq = _uniform_moments(-Q6_K_SCALE_MAX, Q6_K_SCALE_MAX)
    q_mean, q_sq = _uniform_moments(0, 63)
    centred_sq = q_sq - 2 * 32 * q_mean + 32**2  # E[(q - 32)^2]
    return WEIGHT_STD / np.sqrt(sc_sq * centred_sq)


def _q3_k_scale() -> float:
    """d for Q3_K: w = d (sc - 32) q with sc - 32 uniform in -32..31 and q in -4..3, independent."""
    sc_mean, sc_sq = _uniform_moments(-32, 31)
    q_mean, q_sq = _uniform_moments(-4, 3)
    return WEIGHT_STD / np.sqrt(sc_sq * q_sq - (sc_mean * q_mean) ** 2)


def _f16_bytes(value: float, blocks: int) -> np.ndarray:
    scale = np.float16(value)
    if not np.isfinite(scale) or scale == 0:  # a guard on the arithmetic above, not on input
        raise AssertionError(f"block scale {value} is not a finite non-zero f16")
    return np.full(blocks, scale, dtype=np.float16).view(np.uint8).reshape(blocks, 2)


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes ``[rows, cols / block weights * block bytes]`` (uint8) of random ``qtype`` blocks."""
    if qtype not in BLOCK:
        raise ValueError(f"random blocks are written in {', '.join(BLOCK)}, not {qtype}")
    per_block, nbytes = BLOCK[qtype]
    if cols % per_block:
        raise ValueError(f"a {qtype} row needs a multiple of {per_block} columns, got {cols}")
    blocks = rows * (cols // per_block)
    raw = np.empty((blocks, nbytes), dtype=np.uint8)
    if qtype == Q8_0:
        raw[:, 2:] = _random_bytes(rng, (blocks, 32))  # int8 codes uniform in -128..127
        _, q_sq = _uniform_moments(-128, 127)
        raw[:, :2] = _f16_bytes(WEIGHT_STD / np.sqrt(q_sq), blocks)
    elif qtype == Q4_0:
        low, high = rng.integers(1, 16, size=(2, blocks, 16), dtype=np.uint8)  # 1..15 minus 8: symmetric
        raw[:, 2:] = low | (high << 4)
        _, q_sq = _uniform_moments(-7, 7)
        raw[:, :2] = _f16_bytes(WEIGHT_STD / np.sqrt(q_sq), blocks)
    elif qtype in (Q5_0, Q5_1):
        low = 1 if qtype == Q5_0 else 0  # Q5_0: 1..31 minus 16, symmetric
        q = rng.integers(low, 32, size=(blocks, 32), dtype=np.uint8)
        _, q_sq = _uniform_moments(low - 16, 15) if qtype == Q5_0 else _uniform_moments(0, 31)
        d = WEIGHT_STD / np.sqrt(q_sq if qtype == Q5_0 else q_sq - 15.5**2)
        raw[:, :2] = _f16_bytes(d, blocks)
        if qtype == Q5_1:
            raw[:, 2:4] = _f16_bytes(-15.5 * float(np.float16(d)), blocks)
        at = 2 if qtype == Q5_0 else 4
        raw[:, at : at + 4] = np.packbits(q >> np.uint8(4), axis=-1, bitorder="little")
        raw[:, at + 4 :] = (q[:, :16] & np.uint8(15)) | (q[:, 16:] << np.uint8(4))
    elif qtype in (Q4_K, Q5_K):
        d, dmin = _q4_k_scales(15, 63) if qtype == Q4_K else _q4_k_scales(31, 31)
        raw[:, 0:2] = _f16_bytes(d, blocks)
        raw[:, 2:4] = _f16_bytes(dmin, blocks)
        raw[:, 4:] = _random_bytes(rng, (blocks, nbytes - 4))  # scales and mins, (5th bits,) then the codes
        if qtype == Q5_K:
            raw[:, 4:12] &= np.uint8(Q5_K_SCALE_MASK)
    elif qtype == Q3_K:
        raw[:, :108] = _random_bytes(rng, (blocks, 108))  # hmask, low 2 bits, 6-bit scales
        raw[:, 108:110] = _f16_bytes(_q3_k_scale(), blocks)
    else:  # Q6_K
        raw[:, :192] = _random_bytes(rng, (blocks, 192))  # low 4 bits, then high 2 bits, of each code
        raw[:, 192:208] = rng.integers(-Q6_K_SCALE_MAX, Q6_K_SCALE_MAX + 1, size=(blocks, 16),
                                       dtype=np.int8).view(np.uint8)
        raw[:, 208:210] = _f16_bytes(_q6_k_scale(), blocks)
    return raw.reshape(rows, -1)


def _random_bytes(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Uniform random bytes: ``Generator.bytes`` is several times faster than ``integers`` over the 17 GB of a
    30 B-parameter file."""
    return np.frombuffer(rng.bytes(shape[0] * shape[1]), dtype=np.uint8).reshape(shape)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_type(name: str, num_layers: int, tied_embeddings: bool) -> str | None:
    """The type llama.cpp's Q4_K_M gives the tensor ``name`` (``blk.3.attn_v.weight``), None for one it leaves
    unquantized (norms, the router ``ffn_gate_inp``). The output (or a tied embedding, which is the output too)
    Q6_K; attn_v and ffn_down (the experts' ``ffn_down_exps`` too) Q6_K in ``use_more_bits`` layers; everything
    else Q4_K. llama.cpp counts attn_v tensors and ffn_down by layer; one of each per layer, so both are the
    layer index. Its branches for 8-expert models (attn_v, attn_k Q8_0; attn_output Q5_K) are Mixtral's: the
    shapes here have none."""
    if name.endswith("_norm.weight") or "ffn_gate_inp" in name:
        return None
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        return Q6_K
    if name == "token_embd.weight":
        return Q4_K
    layer = int(name.split(".")[1])
    if ".attn_v." in name or ".ffn_down" in name:
        return Q6_K if use_more_bits(layer, num_layers) else Q4_K
    return Q4_K


def q3_k_m_type(name: str, num_layers: int, tied_embeddings: bool) -> str | None:
    """The type llama.cpp's Q3_K_M gives the tensor ``name``, None for one it leaves unquantized. The output
    (or a tied embedding) Q6_K; attn_v Q5_K in the first two layers, else Q4_K; ffn_down (``ffn_down_exps``
    too) Q5_K in the first sixteenth of the layers, else Q4_K; attn_output Q4_K; everything else, an untied
    embedding included, Q3_K. (Its 8-expert branches are Mixtral's, as in ``q4_k_m_type``.)"""
    if name.endswith("_norm.weight") or "ffn_gate_inp" in name:
        return None
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        return Q6_K
    if name == "token_embd.weight":
        return Q3_K
    layer = int(name.split(".")[1])
    if ".attn_v." in name:
        return Q5_K if layer < 2 else Q4_K
    if ".ffn_down" in name:
        return Q5_K if layer < num_layers // 16 else Q4_K
    if ".attn_output." in name:
        return Q4_K
    return Q3_K
