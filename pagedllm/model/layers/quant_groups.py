"""A fused weight whose rows come in more than one GGUF type, kept quantized part by part.

llama.cpp's mixes do this: a Q4_K_M file holds a layer's q and k projections in Q4_K and its v projection
in Q6_K (and ffn_down in Q6_K in some layers), while pagedllm fuses q, k and v into one linear. Each
contiguous run of rows of one type stays its own ``QuantizedWeight`` (at the file's size, on its own
kernel), and the product is the parts' products side by side, each row's sums exactly the ones the part's
kernel forms: so the result is what the separate projections give, and batch invariance holds as it
does for each part. The one-call fused decoder (model/layers/fused_decoder.py) takes up to three groups a
linear and runs them the same way, group by group into one output.

    rows:   [ q (Q4_K) | k (Q4_K) | v (Q6_K) ]   ->   groups: [(0, Q4_K part of q+k), (q+k, Q6_K part of v)]
"""

from __future__ import annotations

import torch


class QuantizedRowGroups:
    """``[n, k]`` as consecutive row groups, each a ``QuantizedWeight`` of one type."""

    packed = None  # no single panel tensor: each group has its own

    def __init__(self, groups: list) -> None:
        self.groups = groups
        self.n = sum(g.n for g in groups)
        self.k = groups[0].k
        self.qtype = groups[0].qtype
        self.kernel_type = None
        self.isa = groups[0].isa

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, product=None) -> torch.Tensor:
        """``x [..., k] @ W^T (+ bias)``: each group's rows by its own kernel (``product(x, group, bias)``
        instead of ``group.matmul`` where a caller chooses the call, e.g. the batch-invariant one)."""
        outs, start = [], 0
        for group in self.groups:
            part_bias = None if bias is None else bias[start : start + group.n]
            outs.append(product(x, group, part_bias) if product is not None else group.matmul(x, part_bias))
            start += group.n
        return torch.cat(outs, dim=-1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("rows of a weight in several row groups (only linears take it)")

    def use_int8_activations(self) -> bool:
        """Each group switched to its int8-activation kernel where it has one; True if any did."""
        return any([g.use_int8_activations() for g in self.groups])
