"""Activations of gated MLPs: SiLU-and-multiply (Llama) and GeGLU with tanh GELU (Gemma)."""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers import cpu_fused


class SiluAndMul(nn.Module):
    """``[..., 2*d] -> silu(x[..., :d]) * x[..., d:]`` (gate first, then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_fused.usable(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1 and ops.silu_and_mul is not None:
            return ops.silu_and_mul(x)  # one call, no fork at decode sizes (cpu_fused)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The reference definition."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place on silu's fresh output: one allocation less


class GeluTanhAndMul(nn.Module):
    """``[..., 2*d] -> gelu_tanh(x[..., :d]) * x[..., d:]``: GeGLU with the tanh approximation
    (Gemma's ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


def gated_activation(name: str) -> nn.Module:
    """The gated-MLP activation for a config's ``hidden_act`` / ``hidden_activation``."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul()
    raise ValueError(f"unsupported MLP activation {name!r}; supported: silu, gelu_pytorch_tanh")
