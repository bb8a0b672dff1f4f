"""Activations: SiLU-and-multiply for gated MLPs."""

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
