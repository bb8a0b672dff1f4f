"""RMSNorm, computed in float32 like the reference, with an optional fused residual add.

On CPU float32 with the compiled library, one call each (``cpu_fused``); ``forward_native`` is the
reference definition and the path everywhere else.
"""

import torch
from torch import nn

from pagedllm.model.layers import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused call instead of five: in float32 it rounds exactly like the steps below
            # (tests/model/test_norm.py), and at decode the five calls cost more than their arithmetic.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        weight = self.weight  # read once: a parameter lookup goes through nn.Module.__getattr__ (~1-2 us)
        ops = cpu_fused.usable(x)
        if (ops is not None and ops.rms_norm is not None and x.dim() == 2 and x.stride(-1) == 1
                and weight.dtype == torch.float32):
            if residual is None:
                return ops.rms_norm(x, weight, self.eps)
            if residual.dtype == torch.float32 and residual.shape == x.shape and residual.stride(-1) == 1:
                return ops.add_rms_norm(x, residual, weight, self.eps)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
