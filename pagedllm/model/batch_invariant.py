"""The batch-invariant mode (``--batch-invariant``, issue 29): one request's logits, hence its
logprobs, are bitwise the same alone and in any batch, whatever the chunking of its prompt, prefix
-cache hits, preemption (recompute or swap), speculative decoding (n-gram or a draft model) and the
thread count, at any one tensor_parallel_size.

It chooses, per kernel, a call whose per-row reduction order is fixed:

* float32 linears and the LM head: ``gemm_packed_invariant_cpu`` (``csrc/cpu_gemm_kernel.h``,
  ``INV``), at every row count (never MKL, whose blocking varies with the row count). Each row's
  sum is one FMA chain k = 0..K-1, then the bias, in every row block (the default kernel splits K
  over 2-4 accumulator sets in blocks of 1-4 rows); 1-2 rows take 4 or 2 panels at once for their
  independent sums instead. Each panel is one thread's, so the thread count does not matter.
* GGUF-quantized linears: ``quant_gemm_invariant_cpu`` (``csrc/quant_gemm_kernel.h``,
  ``INV_SPLIT``): every row block splits K over the same number of accumulator sets, 4 on AVX-512
  (the default's 1-row order, so batch 1 runs at the default's speed; blocks of at most 6 rows keep
  the 24 sums in registers) and 2 on AVX2 (blocks of at most 2 rows). The default kernel uses 4, 2
  or 1 sets by the block's rows. (Taking 4 panels at once with one set, as the float32 kernel
  does, streamed the weight 1.35x slower at 1 row: the quantized kernel is compute-bound.)
* linears on the int8-activation kernel (``csrc/quant_gemm_int8_kernel.h``, the default for a GGUF's
  quantized weights): its one call, invariant as it is. Each row of x is quantized on its own (per
  32-wide block: its scale and int8 values depend on that row alone); a block's integer dot products
  are exact, so how many chains the row block splits them over (1-4, by its rows) changes nothing;
  and the float sum runs block by block in K order, one FMA per block, in every row block. Threads
  split the output columns (panels), never K. The fused decoder step's op routes these types the same
  way (``csrc/decoder_layer.cpp``).
* attention (``csrc/paged_attention_op.cpp``): ``num_splits=1`` (never split a context: the
  automatic split depends on the batch's items and the thread count) and every item on the per-key
  path (``tile_min_rows`` beyond any item; which of the two paths a row took depended on its
  chunk's length and on the batch's long chunks), so each row sums its keys in position order.
* the fused decoder step (``model/layers/fused_decoder.py``) stays on, with the same three choices.
* the bf16 greedy LM head (AMX CPUs) is off: it returns ids only, and not from these logits.
* tensor parallelism: each rank applies the above to its shard (its ranks take the compiled attention
  op, not the torch reference they use otherwise). The row-parallel linears add the ranks' partial
  sums in rank order (``tp_all_reduce_in_rank_order``; gloo's ring all-reduce orders each element's
  sum by the segment it falls in, which moves with the row count, from 3 ranks on); the
  vocab-parallel embedding's all-reduce adds one rank's row to zeros and the LM head's all-gather
  concatenates, exact as they are. Invariant within one tensor_parallel_size, not equal to another:
  a row-parallel linear sums its K in tp pieces, then the pieces.
* mixture-of-experts layers (``model/layers/moe.py``): the router and each expert through the same
  GEMMs (an expert's row count moves with the batch's routing), each token's k weighted outputs
  added in choice order, the tensor-parallel sum in rank order.
* speculative decoding: a verify step's k + 1 rows of a request go through the same kernels, so its
  scores equal those of plain decoding. A draft model keeps its default kernels: its proposals only
  change how many are accepted, never what the target computes.

Until session 10 the mode padded 1-4-row calls to 5 rows (3 for the quantized kernel), whose
blocks keep one accumulator set, and turned the fused decoder step off: 0.69-0.81x the default's
batch-1 decode rate (docs/benchmarks.md).

Norms, rotary, softmax and log_softmax are row-wise already (the tests check it). The mode needs the
compiled library; ``apply`` raises where it is missing rather than fall back to MKL.
"""

from __future__ import annotations

import torch
from torch import nn

INVARIANT_KERNELS = True
"""The linears' invariant kernels; False plants the default ones (k-split order for 1-4 rows) in
the mode, which the tests must catch (tests/engine/test_batch_invariance.py)."""
ATTENTION_NUM_SPLITS = 1
"""paged_attention_cpu's num_splits: 1 = no item is split over its context."""
ATTENTION_TILE_MIN_ROWS = 1 << 30
"""paged_attention_cpu's tile_min_rows: beyond any item, so all rows take the per-key path."""


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The compiled float32 GEMM (``x`` 2-D float32, dense rows) in the invariant order."""
    op = torch.ops.pagedllm.gemm_packed_invariant_cpu if INVARIANT_KERNELS else torch.ops.pagedllm.gemm_packed_cpu
    return op(x, packed, bias, n)


def quant_gemm(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """A GGUF-quantized weight's product (``x`` 2-D float32, dense rows) in the invariant order; a weight on
    the int8-activation kernel takes its one call, invariant as it is (module docstring)."""
    from pagedllm.model.layers.quantized import INT8_KERNEL_TYPE

    invariant = INVARIANT_KERNELS and weight.kernel_type not in INT8_KERNEL_TYPE.values()
    op = torch.ops.pagedllm.quant_gemm_invariant_cpu if invariant else torch.ops.pagedllm.quant_gemm_cpu
    return op(x, weight.packed, weight.kernel_type, weight.n, bias, weight.isa)


def apply(model: nn.Module, attn_backend) -> None:
    """Switch ``model``'s linears, LM head and ``attn_backend`` to their invariant calls (see the
    module docstring); ValueError where a kernel has no invariant call here."""
    from pagedllm.model.attention.backend import CpuAttentionBackend
    from pagedllm.model.layers.embedding import LMHead
    from pagedllm.model.layers.linear import LinearBase
    from pagedllm.model.layers.moe import SparseMoE

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
        if isinstance(module, SparseMoE):
            module.make_batch_invariant()
        if isinstance(module, (LinearBase, LMHead)):
            if module.quant_weight is None and module.gemm_weight is None:
                raise ValueError(f"batch_invariant: {name or 'the model'} has no compiled GEMM weight (library "
                                 "missing, PAGEDLLM_DISABLE_CPU_GEMM set, or not float32 on the CPU)")
            module.batch_invariant = True
            if isinstance(module, LMHead):
                module.greedy_head = None
    attn_backend.batch_invariant = True
    from pagedllm.model.layers import fused_decoder

    fused_decoder.invalidate(getattr(model, "model", model))  # built again with the mode's kernels
