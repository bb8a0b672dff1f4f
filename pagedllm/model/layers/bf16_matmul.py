"""``--dtype bf16-matmul``: a float32 pooling model whose layers' linears multiply bf16-rounded inputs and weights,
summing and returning float32.

Only the rounding of the matmuls' two operands is bf16. The residual stream, LayerNorm / RMSNorm, attention
(its scores and softmax), activations, pooling, Dense heads, Normalize, and a cross-encoder's pooler and
classifier stay float32. Rounding the whole model to bf16 moved a 28-layer decoder's vectors to cosine 0.99985 of
sentence-transformers' float32 ones; rounding only the linears' operands kept it at 0.99994 (docs/embeddings.md,
"Where the bfloat16 error comes from").

Where the CPU has AMX-BF16 (``torch.ops.pagedllm.bf16_matmul_available``), each weight is packed once for the
compiled op (``csrc/bf16_matmul_op.cpp``: oneDNN's AMX ukernel, float32 sums and output). Elsewhere the same
products are formed by a float32 matmul of the bf16-rounded operands (the same rounding; only the order of the
float32 sums differs): no faster than float32, so ``auto`` never picks the mode there.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.attention import cpu_op
from pagedllm.model.layers.greedy_head import cpu_has_fast_bf16

logger = logging.getLogger(__name__)

NAME = "bf16-matmul"
"""The ``--dtype`` value that asks for the mode."""
_GELU = 1
"""``bf16_matmul_cpu``'s activation code for GELU."""


def compiled_available() -> bool:
    """Whether the AMX op runs here (the library built and the CPU's AMX-BF16 ukernel present)."""
    return cpu_op.load() and bool(torch.ops.pagedllm.bf16_matmul_available())


class Bf16Matmul:
    """``x W^T (+ bias)`` with x and W rounded to bf16, float32 sums and output."""

    __slots__ = ("n", "packed", "weight_bf16")

    def __init__(self, weight: torch.Tensor, compiled: bool) -> None:
        self.n = int(weight.shape[0])
        usable = compiled and weight.shape[1] % 2 == 0  # the op packs VNNI pairs along K
        self.packed = torch.ops.pagedllm.bf16_matmul_pack(weight.detach()) if usable else None
        self.weight_bf16 = None if usable else weight.detach().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False) -> torch.Tensor:
        """``gelu``: GELU (the erf form) applied to the product too, by the op on each output tile while it is in
        cache (a pass over the output saved; within an ulp or two of torch's gelu)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.packed is not None:
            y = torch.ops.pagedllm.bf16_matmul_cpu(x2.float(), self.packed, bias, self.n, _GELU if gelu else 0)
        else:
            y = F.linear(x2.to(torch.bfloat16).float(), self.weight_bf16.float(), bias)
            if gelu:
                torch.ops.aten.gelu_(y)
        return y.view(*shape[:-1], self.n)


class Bf16MatmulLinear(nn.Module):
    """An ``nn.Linear`` (an encoder's) in the mode: same parameters and names, the product by ``Bf16Matmul``."""

    def __init__(self, linear: nn.Linear, compiled: bool) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.matmul = Bf16Matmul(linear.weight, compiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


def choose(dtype: str, runner: str, device: torch.device, scores: bool = False) -> tuple[bool, str]:
    """Whether a model runs in the mode, and why (one line for the start-up log). ``dtype`` as given; ``scores``:
    a cross-encoder, which ``auto`` keeps float32 (its scores moved by up to ~4e-4 in the mode, over the 1e-4
    they are held to against CrossEncoder.predict; docs/embeddings.md)."""
    if dtype == NAME:
        if device.type != "cpu":
            raise ValueError(f"dtype {NAME!r} runs on the CPU only")
        if runner != "pooling":
            raise ValueError(f"dtype {NAME!r} applies to runner 'pooling' only, got runner {runner!r}")
        if not cpu_has_fast_bf16():
            return True, (f"dtype {NAME}: linears on bf16-rounded operands, float32 sums; this CPU has no AMX-BF16, "
                          "so they run as float32 matmuls (no faster than dtype float32)")
        return True, f"dtype {NAME}: linears on bf16-rounded operands through AMX tiles, float32 sums and the rest"
    if dtype != "auto" or runner != "pooling" or device.type != "cpu":
        return False, ""
    if not cpu_has_fast_bf16():
        return False, (f"dtype auto: float32 (this CPU has no AMX-BF16 tiles, where {NAME} would be no faster)")
    if scores:
        return False, (f"dtype auto for a cross-encoder: float32 ({NAME} moves its scores by up to ~4e-4; "
                       f"ask for it with dtype {NAME})")
    return True, (f"dtype auto on a CPU with AMX-BF16 for a pooling model: {NAME} (linears on bf16-rounded operands "
                  "through AMX tiles, float32 sums, norms, attention and pooling; dtype float32 for the exact path)")


def apply(model: nn.Module) -> int:
    """Put every float32 linear of ``model``'s layers in the mode; returns how many. Heads (a cross-encoder's
    pooler and classifier, an LM head) and quantized weights stay as they are."""
    from pagedllm.model.layers.linear import LinearBase

    compiled = compiled_available()
    layers = [m for name, m in model.named_modules() if name.endswith(("layer", "layers")) and
              isinstance(m, nn.ModuleList)]
    count = 0
    for stack in layers:
        for parent in list(stack.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, LinearBase) and child.quant_weight is None and child.lora is None and \
                        child.weight.dtype == torch.float32 and not child.batch_invariant:
                    child.bf16_matmul = Bf16Matmul(child.weight, compiled)
                    child.gemm_weight = child.packed_weight = None  # the mode's copy replaces the float32 panels
                    count += 1
                elif type(child) is nn.Linear and child.weight.dtype == torch.float32:
                    setattr(parent, child_name, Bf16MatmulLinear(child, compiled))
                    count += 1
            if hasattr(parent, "fuse_qkv"):  # an encoder's q/k/v as one product (model/bert.py)
                parent.fuse_qkv(lambda weight: Bf16Matmul(weight, compiled))
                for projection in (parent.query, parent.key, parent.value):
                    projection.matmul = None  # their packed copies: the fused one replaces them
    logger.debug("%d linears in %s (%s)", count, NAME, "AMX op" if compiled else "float32 matmul of bf16 operands")
    return count
