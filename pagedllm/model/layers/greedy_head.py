"""Exact greedy tokens from a bfloat16 pass over the LM head, where the CPU multiplies bfloat16 fast.

A greedy step needs only each row's argmax of ``hidden @ W^T``; the float32 head is 49152 x 576
for the default model, ~20% of a step's arithmetic at 64 rows. On CPUs with AMX-BF16 torch's
bfloat16 matmul (oneDNN) ran the head 2-4x faster than float32 at 4-128 rows (docs/benchmarks.md,
"Kernel choices behind the defaults"). Its logits are approximate, so they only choose candidates; the answer is exact:

1. ``y~ = bf16(h) @ bf16(W)^T`` (bfloat16 out). Against the exact ``z_v = h . w_v``, each element is
   off by at most ``e_v = g * |h| * |w_v| + u / (1 - u) * |y~_v|``: ``g`` covers rounding h and W
   to bfloat16 (unit roundoff u = 2^-8 each) and float32 accumulation over K (Cauchy-Schwarz over
   the products' errors); the second term the bfloat16 rounding of the output.
2. ``L = max_v (y~_v - e_v)`` is a lower bound of the largest exact logit, so only the v with
   ``y~_v + e_v >= L`` can be the argmax: the candidates (on the ShareGPT-like trace a median of 1
   per row, at most 228 of 49152; the margin also covers float32 ties, ``K * 2^-24`` of the same
   scale). With one ``|w|`` for all tokens (the largest) instead of each token's own, 15% of rows
   had over 256 candidates.
3. The candidates' logits are recomputed in float32 and the first maximum wins, as argmax does.

Steps 2-3 are one compiled op (``greedy_select_cpu``, csrc/greedy_select.cpp: two passes over each
row's bfloat16 logits, AVX-512 where the CPU has it), since torch's bfloat16 reductions and
``nonzero`` over [N, V] cost as much as the float32 head saved. The whole greedy head measured
0.22-0.48x the float32 head's time at 8-64 rows (docs/benchmarks.md).

So the token is the float32 argmax up to float32 summation order, as with any GEMM. Used only for
rows that want nothing but the argmax (greedy, no logprobs, nothing rewriting logits; the model
runner checks), at ``MIN_ROWS`` rows and up (fewer rows read the weight at the same rate either
way), on CPUs with AMX tiles and AVX-512-BF16 (elsewhere bfloat16 matmuls ran ~100x slower than
float32). ``PAGEDLLM_DISABLE_BF16_GREEDY_HEAD=1`` turns it off (A/B switch). A row whose
candidates cannot be bounded (NaN/inf logits) or too many candidates send the step back to the
float32 logits.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from pagedllm import envs

DISABLE_ENV = "PAGEDLLM_DISABLE_BF16_GREEDY_HEAD"
MIN_ROWS = 4
ROW_BUCKET = 16
"""Rows of the bfloat16 product are zero-padded to a multiple of this: oneDNN builds and keeps a primitive for
each row count it multiplies (~1 MiB each here), so one per batch size would grow the process up to max_num_seqs
of them; at 16 a batch pads at most 15 rows, which costs little where the head reads its weight anyway."""
MAX_CANDIDATES_PER_ROW = 256
_UNIT_ROUNDOFF_BF16 = 2.0**-8
_UNIT_ROUNDOFF_F32 = 2.0**-24


class GreedyFallback(enum.Enum):
    """Why a step's greedy tokens come from the float32 logits rather than from this bfloat16 head."""

    NO_GREEDY_HEAD = "the LM head keeps no bfloat16 copy (quantized, batch-invariant, split over ranks, " \
        "switched off, or a CPU without fast bfloat16)"
    FINAL_SOFTCAP = "the logits are soft-capped: tanh keeps their order but may round near ones into a tie"
    FEW_ROWS = f"under {MIN_ROWS} rows, or not float32: the float32 head reads the weight as fast"
    UNBOUNDED_CANDIDATES = "a row's candidates could not be bounded (NaN/inf logits) or were too many"


def cpu_has_fast_bf16() -> bool:
    """AMX tiles and AVX-512-BF16: where oneDNN's bfloat16 matmul beats float32."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)()
                and getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())


def _bf16_linear(weight_bf16: torch.Tensor):
    """``x -> x @ weight^T`` in bfloat16: oneDNN's prepacked weight where torch has it (measured
    ~1.1-3x faster than F.linear at 4-64 rows, which reorders the weight at every call)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight_bf16, None)
        linear = torch.ops.mkldnn._linear_pointwise
        probe = torch.zeros(MIN_ROWS, weight_bf16.shape[1], dtype=torch.bfloat16)
        if torch.equal(linear(probe, packed, None, "none", [], ""), F.linear(probe, weight_bf16)):
            return lambda x: linear(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        pass
    return lambda x: F.linear(x, weight_bf16)


def _select_available() -> bool:
    from pagedllm.model.attention import cpu_op

    return cpu_op.load() and hasattr(torch.ops.pagedllm, "greedy_select_cpu")


class GreedyHead:
    """A bfloat16 copy of an LM head's ``[vocab, hidden]`` weight and the bound that makes its
    argmax exact. ``build`` returns None where it would not pay (see the module doc)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight_bf16 = weight.detach().to(torch.bfloat16).contiguous()
        self._linear = _bf16_linear(self.weight_bf16)
        # Each token's |w_v|, a hair above its float32 value so the bound's own rounding cannot shrink it.
        self.row_norms = (weight.detach().double().norm(dim=1) * (1 + 2.0**-20)).float().contiguous()
        hidden = weight.shape[1]
        u = _UNIT_ROUNDOFF_BF16
        # Rounding h and W (each up to u relative), float32 accumulation over K products, then the
        # float32 result's own order (the ties margin): a safe multiple of each.
        self.gamma = 2 * u + u * u + 2 * (hidden + 2) * _UNIT_ROUNDOFF_F32 * (1 + u) ** 2

    @classmethod
    def build(cls, weight: torch.Tensor, force: bool = False) -> GreedyHead | None:
        """``force`` (tests) builds it on any CPU with the compiled library: still exact, perhaps slow."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        if not force and (envs.PAGEDLLM_DISABLE_BF16_GREEDY_HEAD or not cpu_has_fast_bf16()):
            return None
        if not _select_available():
            return None
        return cls(weight)

    def argmax(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | GreedyFallback:
        """``F.linear(hidden, weight).argmax(-1)`` (``weight`` the float32 head this was built from),
        or why this call should use the float32 logits instead."""
        if hidden.shape[0] < MIN_ROWS or hidden.dtype != torch.float32:
            return GreedyFallback.FEW_ROWS
        rows = hidden.shape[0]
        x = F.pad(hidden.to(torch.bfloat16), (0, 0, 0, -rows % ROW_BUCKET))
        approx = self._linear(x)[:rows]  # [N, V] bfloat16, the padded rows' logits left out
        # g |h| per row, the part of each logit's error bound that does not depend on the token.
        row_scale = (self.gamma * (1 + 2.0**-20)) * torch.linalg.vector_norm(hidden, dim=1)
        u = _UNIT_ROUNDOFF_BF16
        ids = torch.ops.pagedllm.greedy_select_cpu(approx, hidden, weight, self.row_norms, row_scale,
                                                   u / (1 - u) * (1 + 2.0**-20), MAX_CANDIDATES_PER_ROW)
        if bool((ids < 0).any()):
            return GreedyFallback.UNBOUNDED_CANDIDATES
        return ids
