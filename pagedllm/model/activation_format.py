"""Which activations a loaded model's linears take (``--quant-activations``): the rule, in one place.

    auto (default)  a GGUF's quantized weights kept quantized (CPU, float32): int8 activations where the
                    int8 kernel runs, else float32 with one log line saying why; float checkpoints, also
                    those quantized at load (``--quantization int8``), keep float32 activations; the
                    embedded default model keeps float32 activations (``for_model``)
    int8            int8 activations on every linear whose weight type has the int8 kernel
                    (``quantized.INT8_KERNEL_TYPE``), GGUF or quantized at load; an error where the
                    int8 kernel does not run here
    none            float32 activations: the exact mode (the weights dequantized in registers), the
                    one whose greedy tokens equal Hugging Face transformers' on the same weights

The int8 kernel quantizes each row of x per 32-wide block (``csrc/quant_gemm_int8.h``). It reaches the
decoder's linears and the mixture-of-experts experts; the embedding lookup and the LM head keep float32
(the head's logits choose the tokens; docs/int8-activations.md has the measurements behind that).
The K-quants (Q3_K / Q4_K / Q5_K / Q6_K), Q5_0 / Q5_1 and IQ4_NL take their int8 layout when built
(``takes_int8_at_load``; model/layers/kquant.py, q5.py, iq4nl.py), the embedding and a tied LM head included, so they are held at the file's size. A weight type the kernel lacks
(bf16) keeps float32 activations: the switch is per weight (``QuantizedWeight.use_int8_activations``), so a new type plugs in
by adding its entry to ``quantized.INT8_KERNEL_TYPE``.
"""

from __future__ import annotations

import logging

from torch import nn

from pagedllm.model.layers import quantized

logger = logging.getLogger(__name__)


def for_model(requested: str, model: str | None, log: bool = True) -> str:
    """``requested`` as the load of ``model`` takes it: ``auto`` for the embedded default model (None, or its
    .gguf named by path) is ``none``. Its first answers are a newcomer's first impression, and on its best-known
    question ("What is the capital of France?") the first token is a near tie that int8 activations flip, as
    llama.cpp's own 8-bit activations do, into a French non-answer; the float32 path costs this 98 MB model
    little speed (docs/int8-activations.md has both measurements). ``--quant-activations int8`` still gets int8."""
    if requested == "auto" and _is_embedded_default(model):
        if log:
            logger.info("the embedded default model takes float32 activations (--quant-activations auto keeps "
                        "its first answers exact; int8 asks for the int8 kernel)")
        return "none"
    return requested


def _is_embedded_default(model: str | None) -> bool:
    from pathlib import Path

    from pagedllm.errors import ModelLoadError
    from pagedllm.model.model_source import default_gguf_path

    if model is None:
        return True
    try:
        return Path(model).expanduser().resolve() == default_gguf_path().resolve()
    except (ModelLoadError, OSError):
        return False


def takes_int8_at_load(requested: str, gguf_quantized: bool, dtype, device: str) -> bool:
    """Whether the load should build weights that choose their int8 layout at construction (the K-quants,
    which then never exist in the float-activation layout): the same rule as ``apply_activation_format``."""
    import torch

    if requested == "int8":
        return True
    return (requested == "auto" and gguf_quantized and dtype == torch.float32 and torch.device(device).type == "cpu"
            and quantized.int8_kernel_available())


def apply_activation_format(model: nn.Module, requested: str, gguf_quantized: bool) -> str:
    """Switch ``model``'s linears to the activations ``requested`` (module docstring) and log, once, what they
    take; returns "int8" when at least one linear switched, else "none". ``gguf_quantized``: the weights
    came from a GGUF kept quantized. ValueError for an explicit int8 where the int8 kernel does not run."""
    if requested not in quantized.ACTIVATION_FORMATS:
        raise ValueError(f"quant_activations must be one of {', '.join(quantized.ACTIVATION_FORMATS)}, "
                         f"got {requested!r}")
    if requested == "none":
        logger.info("linears take float32 activations: the exact mode")
        return "none"
    if requested == "auto" and not gguf_quantized:
        logger.info("linears take float32 activations (the weights are not a GGUF's kept quantized on the CPU "
                    "in float32; --quant-activations int8 asks for int8 on weights quantized at load)")
        return "none"
    if not quantized.int8_kernel_available():
        from pagedllm.model.attention import cpu_op

        reason = cpu_op.unavailable_reason() or "this CPU has no AVX2"
        if requested == "int8":
            raise ValueError(f"--quant-activations int8: the int8-activation kernel does not run here ({reason}); "
                             "use --quant-activations auto or none")
        logger.info("linears take float32 activations (the int8-activation kernel does not run here: %s)", reason)
        return "none"
    switched, kept, types = use_int8_activations(model)
    if switched == 0:  # asked for by name, worth a warning
        logger.log(logging.WARNING if requested == "int8" else logging.INFO, "linears take float32 activations "
                   "(no linear has a weight type of the int8 kernel: %s)", _int8_type_names())
        return "none"
    logger.info("linears take int8 activations: %d weights (%s), %d keep float32; the embedding and LM head keep "
                "float32 activations unless their table is a K-quant, Q5_0 / Q5_1 or IQ4_NL (kept in its int8 layout "
                "at the file's size) (--quant-activations none for the exact mode)", switched, " / ".join(sorted(types)), kept)
    return "int8"


def use_int8_activations(model: nn.Module) -> tuple[int, int, set[str]]:
    """Switch every linear's (and every mixture-of-experts expert's) quantized weight of a type the int8
    kernel has to it; ``(switched, kept, types)``: the weights switched, those that keep float32 activations
    (float, bf16, or a type without the int8 kernel), and the names of the switched weights' types."""
    from pagedllm.model.layers.linear import LinearBase
    from pagedllm.model.layers.moe import SparseMoE

    switched = kept = 0
    types: set[str] = set()
    for module in model.modules():
        if isinstance(module, LinearBase):
            weights = [module.quant_weight]
        elif isinstance(module, SparseMoE):  # per projection (w13, w2): each expert's weight, or None (float)
            weights = [q for experts in module.experts.quant for q in (experts or [None])]
        else:
            continue
        for quant in weights:
            qtype = None if quant is None else quant.qtype
            if quant is not None and quant.use_int8_activations():
                switched += 1
                types.add(quantized.NAMES.get(qtype, str(qtype)))
            else:
                kept += 1
    return switched, kept, types


def _int8_type_names() -> str:
    return " / ".join(sorted(quantized.NAMES[t] for t in quantized.INT8_KERNEL_TYPE if t in quantized.NAMES))


def use_int8_lm_head(model: nn.Module) -> bool:
    """Give the LM head its own copy of its quantized weight on the int8 kernel (a tied head's embedding keeps
    its layout for the row lookups); False where the head has no weight of an int8 kernel type. Not part of
    any default: ``pagedllm bench accuracy`` measures it (docs/int8-activations.md)."""
    import copy

    head = getattr(model, "lm_head", None)
    quant = getattr(head, "quant_weight", None)
    if quant is None or quant.kernel_type not in quantized.INT8_KERNEL_TYPE:
        return False
    own = copy.copy(quant)
    own.packed = quant.packed.clone()
    if not own.use_int8_activations():
        return False
    head.quant_weight = own
    return True
