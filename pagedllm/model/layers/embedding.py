"""Token embedding and LM head, split over the vocabulary (vocab-parallel).

The vocabulary is padded up to a multiple of tp_size; rank r holds rows
``[r * V_per_rank, (r + 1) * V_per_rank)`` of the table. The embedding looks up the ids that
fall in its range, zeroes the others and all-reduces; the LM head computes its slice of the
logits and all-gathers them, so every rank sees the same full logits (and samples the same way).
At tp_size=1 both are the plain lookup and matmul.

The table stays ``[vocab, hidden]`` row-major (a lookup reads whole rows). On the CPU, in float32,
``LMHead.process_weights_after_loading()`` adds an MKL-packed copy of its slice for the logits GEMM
(packed once, so no call repacks 49152 x 576 floats): 1.25-2.2x F.linear at 8-128 rows, 1 thread;
within noise at 1 row, 0.84x at 512, rare here. It costs about twice the
slice's size, kept even when the head is tied to the embedding, whose table it then leaves as it is.
Where the compiled GEMM is on (``pagedllm.model.layers.cpu_gemm``), the head packs for it instead
(one copy the size of the slice, no MKL copy) and uses it for 1-256 rows, as the linears do.
Without either (a build without MKL, another architecture) the head uses ``F.linear``.

A GGUF table loaded still quantized (``pagedllm.model.layers.quantized``) stays so: a lookup
dequantizes only the looked-up rows, and the head (its own table, or the embedding's when tied:
the ``QuantizedWeight`` rides on the shared parameter) runs the quantized kernel.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import tp_all_gather, tp_all_reduce
from pagedllm.model import batch_invariant
from pagedllm.model.layers.greedy_head import GreedyHead
from pagedllm.model.layers import quantized
from pagedllm.model.layers.linear import NO_INVARIANT_GEMM, invariant_matmul, pack_for_cpu, packed_linear
from pagedllm.model.layers.quantized import QuantizedWeight, QuantTensor


class VocabEmbedding(nn.Module):
    quant_weight: QuantizedWeight | None = None  # the table still quantized (GGUF), or None

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self.num_embeddings_per_partition = -(-vocab_size // tp_size)  # ceil
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        num_rows = max(0, min(self.num_embeddings_per_partition, self.vocab_size - self.vocab_start))
        assert loaded.shape[1] == param.shape[1], f"hidden size {loaded.shape[1]} != {param.shape[1]}"
        if isinstance(loaded, QuantTensor):  # padding rows: zero bytes dequantize to zeros in every type
            rows = loaded.narrow(0, self.vocab_start, num_rows)
            if num_rows == param.shape[0]:  # no padding: the rows as they come (no copy of the table)
                quantized.stage(param, 0, rows)
                return
            rows = rows.raw
            padded = torch.zeros(param.shape[0], rows.shape[1], dtype=torch.uint8)
            padded[:num_rows] = rows
            quantized.stage(param, 0, QuantTensor(loaded.qtype, padded, param.shape[1]))
            return
        param.data[num_rows:].zero_()  # padding rows (last rank only)
        param.data[:num_rows].copy_(loaded.narrow(0, self.vocab_start, num_rows))

    def process_weights_after_loading(self) -> None:
        self.quant_weight = quantized.finalize(self.weight)  # else the lookup wants the rows as they are

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is not None:
            return self.quant_weight.rows(ids.reshape(-1)).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings_per_partition)
        embedded = self._lookup(local_ids.masked_fill(outside, 0))  # [T, hidden]
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        # One rank holds each row, the others add zeros: exact in any order (batch-invariant as it is).
        return tp_all_reduce(embedded)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    gemm_weight: torch.Tensor | None = None  # ``weight`` packed for the compiled GEMM, or None
    packed_weight: torch.Tensor | None = None  # MKL-packed copy of ``weight`` (CPU, float32), or None
    greedy_head: GreedyHead | None = None  # bfloat16 copy for exact greedy tokens (greedy_head.py; the model asks it), or None

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int = 1, tp_rank: int = 0):
        super().__init__(vocab_size, hidden_size, tp_size, tp_rank)
        self.batch_invariant = batch_invariant.chosen()

    def process_weights_after_loading(self) -> None:
        self.quant_weight = quantized.finalize(self.weight)  # tied: the embedding's, finalized first
        if self.quant_weight is not None:
            return  # no float copies, no bfloat16 greedy head: the logits come from the kernel
        self.gemm_weight, self.packed_weight = pack_for_cpu(self.weight.detach())
        if self.batch_invariant:  # its ids come from a bfloat16 copy, not from the mode's logits: off
            if self.gemm_weight is None:
                raise ValueError(NO_INVARIANT_GEMM.format("the LM head"))
            return
        self.greedy_head = GreedyHead.build(self.weight) if self.tp_size == 1 else None

    batch_invariant: bool = False  # row-count-independent sums: chosen at construction (model/batch_invariant.py)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        if self.batch_invariant:
            logits = invariant_matmul(hidden_states, None, self.quant_weight, self.gemm_weight, self.weight.shape[0])
        elif self.quant_weight is not None:
            logits = self.quant_weight.matmul(hidden_states)
        elif self.gemm_weight is not None:
            logits = packed_linear(hidden_states, self.weight, None, self.gemm_weight, None)
        elif packed is not None and hidden_states.is_cpu and hidden_states.dtype == torch.float32:
            # The op uses the packed copy only when the row count equals the batch size it is
            # given; the packed layout does not depend on it, so give it this call's row count.
            logits = torch.ops.mkl._mkl_linear(hidden_states, packed, self.weight, None, hidden_states.shape[0])
        else:
            logits = F.linear(hidden_states, self.weight).float()  # [N, V_per_rank]
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[:, : self.vocab_size]  # [N, vocab]
