"""GGUF-quantized weights kept quantized in memory (Q8_0, Q4_0, Q4_1 in their own size; Q3_K, Q4_K, Q5_K,
Q6_K, Q5_0, Q5_1, IQ4_NL expanded to 12 bits a weight for float activations, at their own size for int8 ones),
multiplied by the compiled kernel of ``csrc/quant_gemm*.cpp``; float checkpoints kept as bf16 or int8 panels for the same kernel. This module is what a load does with them:
it stages a layer's shards and installs the repacked weight, and it decides which float weights convert.
The bytes and panel layouts are ``quant_layout.py``'s, the weight and its product ``quant_weight.py``'s;
their names are reachable from here too.

The loader hands a linear's weight loader a ``QuantTensor`` (the GGUF rows, still quantized)
instead of a float tensor; the loader stores it with ``stage`` (on the parameter, at the row
offset a fused QKV / gate-up shard goes to), which repacks the rows once into the kernel's layout
as soon as they cover the weight (so a load holds one weight's source bytes at a time, not the
file's), and ``finalize`` (from ``process_weights_after_loading``) installs the result. No float32
copy is kept, and the float parameter is left empty (``[out, 0]``). The dequantized values are bit
for bit gguf's numpy ones, so the product equals the dequantize-then-float32 path up to summation order.

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

With int8 activations the K-quants, Q5_0 / Q5_1 and IQ4_NL skip the expansion: the loader marks each parameter
(``mark_int8_activations``) before the weights load, and ``stage`` repacks a marked weight of these types
straight into the int8 kernel's file-size layout (``kquant.py``, csrc/quant_gemm_kq.h; ``q5.py`` and
``iq4nl.py``, csrc/quant_gemm_int8.h).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.model.layers.quant_layout import (  # noqa: F401 - the names callers reach through this module
    BF16,
    BF16_KERNEL,
    BLOCK_K,
    GGUF_BLOCKS,
    IQ4_NL,
    INT8_KERNEL_TYPE,
    KERNEL_TYPE,
    NAMES,
    PACKED_BLOCK_BYTES,
    PANEL_ROWS,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QX,
    SUPPORTED,
    QuantTensor,
    dequantize_rows_torch,
    expand_k_quant,
    repack,
    to_int8_layout,
)
from pagedllm.model.layers.quant_weight import (  # noqa: F401 - as above
    ISA_CODES,
    QuantizedWeight,
    dequantize_rows,
    int8_kernel_available,
    kernel_available,
    kernel_isa,
    quantize_activations,
)

logger = logging.getLogger(__name__)

ACTIVATION_FORMATS = ("auto", "none", "int8")
"""``--quant-activations``: int8 quantizes the activations per 32-wide block of a row (one float32 scale
each, as Q8_0) for integer dot products with the linears' quantized weights (the types in
``INT8_KERNEL_TYPE``); none keeps them float32 (the weights dequantized in registers, the exact mode);
auto, the default, is int8 for a GGUF's quantized weights where the int8 kernel runs, else none."""


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
    """Have ``stage`` build ``param``'s K-quant or Q5 weight in the int8-activation layout (``kquant.py``,
    ``q5.py``)."""
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
