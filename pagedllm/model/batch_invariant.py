"""The batch-invariant mode (``--batch-invariant``, issue 29): one request's logits, hence its
logprobs, are bitwise the same alone and in any batch, whatever the chunking of its prompt, prefix
-cache hits, preemption by recompute and the thread count.

It changes no kernel; it only chooses, per kernel, a call whose per-row reduction order is fixed:

* float32 linears and the LM head: the compiled packed GEMM (``csrc/cpu_gemm_kernel.h``) for every
  row count. Its order per row depends only on the row block it lands in: blocks of 1-2 rows split
  K over 4 accumulator sets, 3-4 rows over 2, 5+ rows keep one set, a plain FMA chain k = 0..K-1
  (the K-chunked sweep continues the same chain; each panel is one thread's, so the thread count
  does not matter). So every call here has at least ``GEMM_MIN_ROWS`` rows (zero-padded) and is cut
  into calls of at most 256 rows (never MKL, whose blocking varies with the row count); with at
  least 5 rows, every block the kernel forms has at least 5 (an even split of >14 rows gives 7+).
* GGUF-quantized linears (``csrc/quant_gemm_kernel.h``): the same, with one accumulator set from
  3 rows a block (``QUANT_MIN_ROWS``; the op takes any row count, so no cut is needed).
* attention (``csrc/paged_attention_op.cpp``): ``num_splits=1`` (never split a context: the
  automatic split depends on the batch's items and the thread count) and every item on the per-key
  path (``tile_min_rows`` beyond any item; which of the two paths a row took depended on its
  chunk's length and on the batch's long chunks), so each row sums its keys in position order.
* the bf16 greedy LM head (AMX CPUs) is off: it returns ids only, and not from these logits.

Norms, rotary, softmax and log_softmax are row-wise already (the tests check it). The mode needs the
compiled library; ``apply`` raises where it is missing rather than fall back to MKL.
"""

from __future__ import annotations

import torch
from torch import nn

GEMM_MIN_ROWS = 5
"""Fewest rows per compiled-GEMM call: from 5 rows a block the kernel keeps one accumulator set."""
GEMM_MAX_ROWS = 256
"""Most rows per compiled-GEMM call (the op's tested range; above it the linears used MKL)."""
QUANT_MIN_ROWS = 3
"""Fewest rows per quantized-GEMM call: from 3 rows a block its kernel keeps one accumulator set."""
ATTENTION_NUM_SPLITS = 1
"""paged_attention_cpu's num_splits: 1 = no item is split over its context."""
ATTENTION_TILE_MIN_ROWS = 1 << 30
"""paged_attention_cpu's tile_min_rows: beyond any item, so all rows take the per-key path."""


def rowwise(fn, x: torch.Tensor, min_rows: int, max_rows: int | None) -> torch.Tensor:
    """``fn(x)`` for a 2-D ``x``, called on pieces of ``min_rows``..``max_rows`` rows (the last
    zero-padded up to ``min_rows``), so that each row's result does not depend on how many rows
    came with it."""
    num_rows = x.shape[0]
    step = max_rows or max(num_rows, 1)
    outs = []
    for start in range(0, max(num_rows, 1), step):
        part = x[start : start + step]
        rows = part.shape[0]
        if rows < min_rows:
            part = torch.cat([part, part.new_zeros(min_rows - rows, part.shape[1])])
        outs.append(fn(part)[:rows])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def apply(model: nn.Module, attn_backend) -> None:
    """Switch ``model``'s linears, LM head and ``attn_backend`` to their invariant calls (see the
    module docstring); ValueError where a kernel has no invariant call here."""
    from pagedllm.model.attention.backend import CpuAttentionBackend
    from pagedllm.model.layers.embedding import LMHead
    from pagedllm.model.layers.linear import LinearBase

    if not isinstance(attn_backend, CpuAttentionBackend) or attn_backend._attention is None:
        raise ValueError("batch_invariant needs the compiled CPU attention op (attention_backend 'cpu' or "
                         f"'auto' on the CPU with the library built); got {attn_backend.name!r}")
    from pagedllm.model.attention import cpu_op
    from pagedllm.model.attention.layer import Attention

    for name, module in model.named_modules():
        if isinstance(module, Attention) and module.head_dim not in cpu_op.SUPPORTED_HEAD_DIMS:
            # The op would hand these layers to the torch reference (SDPA), whose sums vary.
            raise ValueError(f"batch_invariant: {name} has head_dim {module.head_dim}; the compiled attention "
                             f"op takes {cpu_op.SUPPORTED_HEAD_DIMS}")
        if isinstance(module, (LinearBase, LMHead)):
            if module.quant_weight is None and module.gemm_weight is None:
                raise ValueError(f"batch_invariant: {name or 'the model'} has no compiled GEMM weight (library "
                                 "missing, PAGEDLLM_DISABLE_CPU_GEMM set, or not float32 on the CPU)")
            module.batch_invariant = True
            if isinstance(module, LMHead):
                module.greedy_head = None
    attn_backend.batch_invariant = True
    from pagedllm.model.layers import fused_decoder

    fused_decoder.invalidate(getattr(model, "model", model))  # its C++ loop calls the default kernels: refused
