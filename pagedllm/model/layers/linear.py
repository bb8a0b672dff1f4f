"""Linear layers that own their tensor-parallel sharding (at tp_size=1 the collectives are no-ops).

* ``ColumnParallelLinear`` splits the output features: each rank holds rows ``[rank*n/tp, (rank+1)*n/tp)``.
* ``RowParallelLinear`` splits the input features and all-reduces the partial outputs.
* ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` fuse several column linears; their
  ``weight_loader(param, loaded, shard_id)`` places one Hugging Face tensor into its slice.

Parameters are allocated uninitialized (``torch.empty``): weights always come from a checkpoint.
A loader receives either a tensor or a lazy checkpoint slice (``narrow`` reads only the rows this
rank keeps, ``materialize`` reads everything), so no rank ever holds the full model.

Weights load in the checkpoint's ``[out, in]`` layout; ``process_weights_after_loading()`` (called
once by the loader, after the dtype and device are final) then re-lays a float32 CPU weight out
column-major: still an ``[out, in]`` tensor whose storage is ``[in, out]``, so the GEMM behind
``F.linear`` reads it untransposed (faster at every decode batch size measured). Values, shapes and
sharding are unchanged, so tensor parallelism and the weight loaders need nothing new. CUDA weights
are left alone.

Then it adds one packed copy of the weight (``pack_for_cpu``). Where the compiled GEMM is on
(``pagedllm.model.layers.cpu_gemm``: the library is built, the CPU has AVX2 + FMA, and
``PAGEDLLM_DISABLE_CPU_GEMM`` is unset), that copy is its panel layout (the weight's size), used for
``GEMM_ROWS`` rows (1-256): it reads the weight once per call, one linear stream per thread, where
MKL's packed GEMM at 4-32 rows did not keep up with the memory. Otherwise (no library, no AVX2,
switched off) it is an MKL-packed copy (``cblas_sgemm_pack`` once; ``mkl_pack``) for ``PACKED_ROWS``
rows; long prefill chunks keep ``F.linear``. Quantized GGUF weights are a ``QuantizedWeight``
(``quantized.py``) instead, and run through their own compiled kernels.

The measurements behind each choice (layouts, compiled GEMM vs MKL per row count and ISA, per-step
effect) are in docs/benchmarks.md, "Kernel choices behind the defaults".
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import tp_all_reduce, tp_all_reduce_in_rank_order
from pagedllm.distributed.shapes import tp_shape
from pagedllm.model import batch_invariant
from pagedllm.model.layers import cpu_gemm, quantized
from pagedllm.model.layers.quantized import QuantizedWeight, QuantTensor

logger = logging.getLogger(__name__)

PACKED_ROWS = (2, 256)
"""Calls with a row count in this range (inclusive) use the MKL packed copy (when the compiled
GEMM is off); others F.linear on the column-major weight (see the module docstring)."""

GEMM_ROWS = (1, 256)
"""Calls with a row count in this range (inclusive) use the compiled packed GEMM, when it is on."""

NO_INVARIANT_GEMM = ("batch_invariant: {} has no compiled GEMM weight (library missing, PAGEDLLM_DISABLE_CPU_GEMM "
                     "set, or not float32 on the CPU)")
"""Why a layer built in the batch-invariant mode refuses its weights (formatted with the layer)."""


def materialize(loaded) -> torch.Tensor:
    """The whole checkpoint tensor (``loaded`` is a tensor or a lazy slice)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_size: int, tp_rank: int):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.batch_invariant = batch_invariant.chosen()

    def _make_params(self, out_features: int, in_features: int, bias: bool) -> None:
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        raise NotImplementedError

    gemm_weight: torch.Tensor | None = None  # ``weight`` packed for the compiled GEMM, or None
    packed_weight: torch.Tensor | None = None  # MKL-packed copy of ``weight`` (CPU, float32), or None
    quant_weight: QuantizedWeight | None = None  # a GGUF-quantized weight (layers/quantized.py), or None
    lora = None  # LoRA adapter slots (pagedllm/lora/layers.py), set when LoRA is enabled; adds the step's deltas
    batch_invariant: bool = False  # row-count-independent sums: chosen at construction (model/batch_invariant.py)
    bf16_matmul = None  # a pooling model's bf16-operand product (layers/bf16_matmul.py), set after loading, or None

    def process_weights_after_loading(self) -> None:
        self.quant_weight = quantized.finalize(self.weight)
        if self.quant_weight is not None:  # the float parameter is empty: nothing to lay out
            return
        to_column_major_on_cpu(self.weight)
        self.gemm_weight, self.packed_weight = pack_for_cpu(self.weight.detach())
        if self.batch_invariant and self.gemm_weight is None:
            raise ValueError(NO_INVARIANT_GEMM.format(f"a {type(self).__name__}"))
        if self.gemm_weight is not None:  # the op's C++ callable, bound once (skips OpOverload.__call__)
            overload = torch.ops.pagedllm.gemm_packed_cpu.default
            self._gemm_op = getattr(overload, "_op", overload)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` by the fastest call for ``x``'s row count."""
        if self.batch_invariant:
            return invariant_matmul(x, bias, self.quant_weight, self.gemm_weight, self._parameters["weight"].shape[0])
        if self.quant_weight is not None:
            return self.quant_weight.matmul(x, bias)
        if self.bf16_matmul is not None:
            return self.bf16_matmul(x, bias)
        gemm_weight = self.gemm_weight
        # packed_linear's compiled-GEMM branch inlined, the op called without its wrappers: at
        # decode the four Python frames and parameter lookups between a layer and the op cost
        # about what the op does (~4 us of ~8, four linears a layer).
        if (gemm_weight is not None and x.dtype == torch.float32 and x.dim() == 2
                and GEMM_ROWS[0] <= x.shape[0] <= GEMM_ROWS[1] and x.stride(1) == 1):
            return self._gemm_op(x, gemm_weight, bias, self._parameters["weight"].shape[0])
        return packed_linear(x, self._parameters["weight"], bias, gemm_weight, self.packed_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self._parameters["bias"])
        return y if self.lora is None else self.lora.apply(x, y)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        super().__init__(input_size, output_size, bias, tp_size, tp_rank)
        self.output_size_per_partition = _divide(output_size, tp_size)
        self._make_params(self.output_size_per_partition, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        store_rows(param, 0, loaded.narrow(0, self.tp_rank * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column linears with the same input fused into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_size, tp_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        shard = _divide(self.output_sizes[shard_id], self.tp_size)
        offset = sum(_divide(s, self.tp_size) for s in self.output_sizes[:shard_id])
        store_rows(param, offset, loaded.narrow(0, self.tp_rank * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; query heads split across ranks, KV heads split or replicated
    (see pagedllm/distributed/shapes.py)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
        bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
    ):
        shape = tp_shape(tp_size, tp_rank, num_heads, num_kv_heads)
        self.head_dim = head_dim
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.kv_head_start = shape.kv_head_start
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, output_size, bias, tp_size, tp_rank)
        self.output_size_per_partition = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self._make_params(self.output_size_per_partition, hidden_size, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        offset, size, start = {
            "q": (0, self.q_size, self.tp_rank * self.q_size),
            "k": (self.q_size, self.kv_size, self.kv_head_start * self.head_dim),
            "v": (self.q_size + self.kv_size, self.kv_size, self.kv_head_start * self.head_dim),
        }[shard_id]
        store_rows(param, offset, loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split across ranks; partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        super().__init__(input_size, output_size, bias, tp_size, tp_rank)
        self.input_size_per_partition = _divide(input_size, tp_size)
        self._make_params(output_size, self.input_size_per_partition, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            param.data.copy_(materialize(loaded))
            return
        shard = param.shape[1]
        store_rows(param, 0, loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if self.lora is not None:  # before the reduction, which sums the ranks' B (A_shard x_shard) to B A x
            y = self.lora.apply(x, y)
        if self.tp_size > 1:
            # The mode needs each element's sum of partials in an order fixed whatever the row count.
            (tp_all_reduce_in_rank_order if self.batch_invariant else tp_all_reduce)(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def store_rows(param: nn.Parameter, offset: int, rows) -> None:
    """Rows ``[offset, offset + len(rows))`` of ``param`` from ``rows``: a tensor is copied in; a
    still-quantized GGUF shard is staged for ``quantized.finalize`` (at process_weights_after_loading)."""
    if isinstance(rows, QuantTensor):
        quantized.stage(param, offset, rows)
    else:
        param.data.narrow(0, offset, rows.shape[0]).copy_(rows)


def to_column_major_on_cpu(weight: nn.Parameter) -> None:
    """Give a float32 CPU ``[out, in]`` weight ``[in, out]`` storage, in place (same values and shape)."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        weight.data = weight.data.t().contiguous().t()


def pack_for_cpu(weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(gemm_weight, mkl_weight)``: the compiled GEMM's packed copy of a float32 CPU ``weight``
    where that GEMM is on, else MKL's (one copy, never both; both None elsewhere)."""
    gemm_weight = cpu_gemm.pack(weight)
    return gemm_weight, (mkl_pack(weight) if gemm_weight is None else None)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  gemm_weight: torch.Tensor | None, mkl_weight: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ bias)`` through the packed copy that suits ``x``'s row count, else F.linear."""
    if x.dim() == 2 and x.dtype == torch.float32:
        rows = x.shape[0]
        if gemm_weight is not None and GEMM_ROWS[0] <= rows <= GEMM_ROWS[1] and x.stride(1) == 1:
            return cpu_gemm.gemm(x, gemm_weight, bias, weight.shape[0])
        if mkl_weight is not None and PACKED_ROWS[0] <= rows <= PACKED_ROWS[1]:
            # The op uses the packed copy only when the row count equals the batch size it is
            # given; the packed layout does not depend on it, so give it this call's row count.
            return torch.ops.mkl._mkl_linear(x, mkl_weight, weight, bias, rows)
    return F.linear(x, weight, bias)


def invariant_matmul(x: torch.Tensor, bias: torch.Tensor | None, quant_weight: QuantizedWeight | None,
                     gemm_weight: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T (+ bias)`` with each row's sum order independent of the other rows (batch-invariant
    mode: the kernels are chosen in model/batch_invariant.py)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float().contiguous()
    if quant_weight is not None:
        y = batch_invariant.quant_gemm(x2, quant_weight, bias)
    else:
        y = batch_invariant.gemm(x2, gemm_weight, bias, n)
    return y.view(*shape[:-1], y.shape[-1])


def mkl_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` packed by MKL for ``torch.ops.mkl._mkl_linear``; None where that cannot be."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    reorder = getattr(torch.ops.mkl, "_mkl_reorder_linear_weight", None)
    if reorder is None:
        logger.info("this torch build has no MKL packed GEMM; the linears use F.linear")
        return None
    try:
        return reorder(weight.contiguous(), 64)  # 64: a size hint; the packed layout is the same for any
    except RuntimeError as e:  # registered but not built in (no MKL)
        logger.info("MKL packed GEMM unavailable (%s); the linears use F.linear", e)
        return None


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}"
    param.data.copy_(materialize(loaded))  # a QuantTensor here (no quantized path) is dequantized
