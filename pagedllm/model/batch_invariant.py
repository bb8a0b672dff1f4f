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

An earlier version of the mode padded 1-4-row calls to 5 rows (3 for the quantized kernel), whose
blocks keep one accumulator set, and turned the fused decoder step off: 0.69-0.81x the default's
batch-1 decode rate (docs/benchmarks.md).

Norms, rotary, softmax and log_softmax are row-wise already (the tests check it). The mode is chosen
when the model is built (``building``): each layer takes its kernels in its constructor, so nothing is
patched afterwards. It needs the compiled library; a layer built in the mode raises ValueError where
it is missing rather than fall back to MKL.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

INVARIANT_KERNELS = True
"""The linears' invariant kernels; False plants the default ones (k-split order for 1-4 rows) in
the mode, which the tests must catch (tests/engine/test_batch_invariance.py)."""
ATTENTION_NUM_SPLITS = 1
"""paged_attention_cpu's num_splits: 1 = no item is split over its context."""
ATTENTION_TILE_MIN_ROWS = 1 << 30
"""paged_attention_cpu's tile_min_rows: beyond any item, so all rows take the per-key path."""

_building = False


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The compiled float32 GEMM (``x`` 2-D float32, dense rows) in the invariant order."""
    op = torch.ops.pagedllm.gemm_packed_invariant_cpu if INVARIANT_KERNELS else torch.ops.pagedllm.gemm_packed_cpu
    return op(x, packed, bias, n)


def quant_gemm(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """A GGUF-quantized weight's product (``x`` 2-D float32, dense rows) in the invariant order; for a weight on
    the int8-activation kernel the invariant call is that kernel as it is (module docstring), never the bf16
    prefill path the plain call takes for many rows on an AMX CPU (csrc/quant_gemm_op.cpp)."""
    if getattr(weight, "groups", None) is not None:  # several row groups, each its own kernel
        return weight.matmul(x, bias, product=quant_gemm)
    op = torch.ops.pagedllm.quant_gemm_invariant_cpu if INVARIANT_KERNELS else torch.ops.pagedllm.quant_gemm_cpu
    return op(x, weight.packed, weight.kernel_type, weight.n, bias, weight.isa)


@contextmanager
def building(enabled: bool) -> Iterator[None]:
    """Layers built inside this block take the mode's kernels when ``enabled``: each reads ``chosen()`` in its
    constructor and refuses, when its weights are processed, where it has no invariant call. The executors wrap
    the target model's load in it; a draft model, built outside, keeps the default kernels."""
    global _building
    previous, _building = _building, enabled
    try:
        yield
    finally:
        _building = previous


def chosen() -> bool:
    """Whether a layer constructed now takes the mode's kernels (inside ``building(True)``)."""
    return _building


def built_for(model) -> bool:
    """Whether ``model`` was built in the mode (its layers that have the choice took it)."""
    return any(getattr(m, "batch_invariant", False) is True for m in model.modules())
