"""Activations: SiLU-and-multiply for gated MLPs."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``[..., 2*d] -> silu(x[..., :d]) * x[..., d:]`` (gate first, then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place on silu's fresh output: one allocation less
