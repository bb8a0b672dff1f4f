"""RMSNorm, computed in float32 like the reference, with an optional fused residual add.

On CPU float32 with the compiled library, one call each (``cpu_fused``); ``forward_native`` is the
reference definition and the path everywhere else.
"""

import torch
from torch import nn

from pagedllm.model.layers import cpu_fused
from pagedllm.model.layers.linear import materialize


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
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``, which on the CPU are written into
        ``x`` and ``residual`` themselves when both are dense: the decoder rebinds both names to the results, and a
        prefill step then holds two [T, hidden] tensors fewer while its layer runs."""
        # The parameter read straight from _parameters: ``self.weight`` misses the instance dict
        # and runs nn.Module.__getattr__ (~0.7 us, twice a layer).
        weight = self._parameters["weight"]
        ops = cpu_fused.usable(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == torch.float32:
            if residual is None:
                if ops.rms_norm is not None:
                    return ops.rms_norm(x, weight, self.eps)
            elif (ops.add_rms_norm is not None and residual.dtype == torch.float32 and residual.dim() == 2
                  and residual.stride(1) == 1 and residual.shape[0] == x.shape[0]
                  and residual.shape[1] == x.shape[1]):
                width = x.shape[1]
                if x.stride(0) == width and residual.stride(0) == width and x.data_ptr() != residual.data_ptr():
                    ops.add_rms_norm_(x, residual, weight, self.eps)
                    return x, residual
                return ops.add_rms_norm(x, residual, weight, self.eps)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by ``1 + w`` (checkpoints store ``w``, zero-centred). The loader adds
    the 1 once, in float32, so the forward is the plain RMSNorm above with its fused CPU paths:
    the same float32 products as HF's ``norm(x) * (1.0 + w)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._load_offset

    @staticmethod
    def _load_offset(param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert param.shape == loaded.shape, (param.shape, loaded.shape)
        param.data.copy_(materialize(loaded).float() + 1.0)
