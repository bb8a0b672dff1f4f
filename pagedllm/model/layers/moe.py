"""Sparse mixture-of-experts MLP: a softmax router picks ``top_k`` experts per token.

Per step, the (token, expert) pairs are sorted by expert so each expert's rows are contiguous;
each chosen expert then runs its gated MLP once over all its rows (two GEMMs), and the outputs are
weighted and summed back into their tokens. No per-token loop and no work for an expert no token
chose::

    tokens x top_k pairs --sort by expert--> [e0 e0 e0 | e2 | e3 e3 ]   (e1 unchosen: skipped)
                                              GEMM(e0)  GEMM(e2) GEMM(e3)
    out[token] = sum over its k pairs of  weight * expert_out   (pairs gathered back in token order)

Routing follows HF: softmax over all experts in float32, top-k of the probabilities, renormalised
to sum to 1 when ``renormalize`` (Mixtral always; Qwen3-MoE when ``norm_topk_prob``), cast back to
the activations' dtype.

Under tensor parallelism every rank holds every expert, sliced along the intermediate dimension as
a dense MLP is (gate/up rows ``[r*I/N, (r+1)*I/N)``, the same columns of down), and the router whole:
each rank routes identically, computes its slice of every chosen expert, weights and sums it, and
one all-reduce per layer (the one a dense MLP's down projection does) adds the slices. Chosen over
expert parallelism (each rank holding E/N whole experts) because decode is bound by reading the
chosen experts' weights: sliced, each rank reads 1/N of every chosen expert, whatever the routing;
split by expert, a step's slowest rank is the one that drew the most chosen experts (at batch 1,
top-8 of 64 experts over 2 ranks: 5 or more of the 8 on one rank 71% of the time, by the
hypergeometric odds), and the tokens would need an all-to-all.

A GGUF's stacked experts stay quantized (Q8_0, Q4_0, Q4_1, K-quants: what the dense quantized
linears take, layers/quantized.py): each expert's gate+up rows and its down rows become one
``QuantizedWeight`` each, and an active expert's rows go through its compiled kernel. Each is repacked
as soon as its last shard comes (up after gate; down alone), as a dense weight is (``quantized.stage``):
the source bytes are views of the file's map, and repacked while the loader is still at their tensor
they are never read again, so the map's pages are dropped as the loader moves on (repacked at the end,
a 17 GB file's pages came back into the resident set beside the 17 GB of repacked experts). The float
parameters are then left empty (``[E, 2*I, 0]``, ``[E, hidden, 0]``). Under tensor parallelism
gate/up are sliced by rows (whole blocks, always quantized) and down by columns: a slice that is
a multiple of the block width stays quantized, one that cuts blocks is dequantized to float32 as
a dense row-parallel shard is (``QuantTensor.narrow`` warns). Each of w13 and w2 decides alone,
so a file with quantized gate/up and float down (rows not in whole blocks) keeps what it can.
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import tp_all_reduce, tp_all_reduce_in_rank_order
from pagedllm.model import batch_invariant
from pagedllm.model.layers.activation import gated_activation
from pagedllm.model.layers import cpu_gemm, quantized
from pagedllm.model.layers.linear import NO_INVARIANT_GEMM, invariant_matmul, materialize, pack_for_cpu, packed_linear
from pagedllm.model.layers.quantized import QuantizedWeight, QuantTensor

logger = logging.getLogger(__name__)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, activation: str = "silu", tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        if intermediate_size % tp_size:
            raise ValueError(f"the experts' intermediate size {intermediate_size} does not split "
                             f"tensor_parallel_size={tp_size} ways")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size
        self.tp_size = tp_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router, whole on every rank
        self.gate.weight.requires_grad_(False)
        self.experts = _StackedExperts(hidden_size, intermediate_size, num_experts, tp_size, tp_rank)
        self.batch_invariant = self.experts.batch_invariant
        self.dense = False  # the benchmark's switch: every expert over every token (forward_dense)
        self.act = gated_activation(activation)

    batch_invariant = False
    """Row-count-independent sums, for the router and (through ``experts``) the experts: chosen at construction
    (model/batch_invariant.py)."""
    _gate_gemm: torch.Tensor | None = None  # the router's weight packed for the compiled GEMM (the mode's)

    def process_weights_after_loading(self) -> None:
        """The mode's router GEMM (the experts pack their own weights); ValueError where it has none."""
        if self.batch_invariant:
            self._gate_gemm = cpu_gemm.pack(self.gate.weight.detach())
            if self._gate_gemm is None:
                raise ValueError(NO_INVARIANT_GEMM.format("a mixture-of-experts router"))

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the activations' dtype, expert ids [T, k] int64) as HF routes."""
        if self.batch_invariant:  # F.linear's (MKL's) blocking varies with the row count
            router_logits = invariant_matmul(hidden_states, None, None, self._gate_gemm, self.num_experts)
        else:
            router_logits = self.gate(hidden_states)  # [T, E]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden_states.dtype), expert_ids

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        out = self.forward_dense(hidden_states) if self.dense else self._grouped(hidden_states)
        if self.tp_size == 1:
            return out
        return (tp_all_reduce_in_rank_order if self.batch_invariant else tp_all_reduce)(out)

    def _grouped(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (its intermediate slice of each chosen expert)."""
        num_tokens, hidden = hidden_states.shape
        weights, expert_ids = self.route(hidden_states)
        flat_experts = expert_ids.reshape(-1)  # [T*k]: pair p is token p // k's choice p % k
        order = torch.argsort(flat_experts, stable=True)  # pairs grouped by expert
        token_of = order // self.top_k  # [T*k]
        # One host read per layer: how many rows each expert has (the GEMM shapes).
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        rows = hidden_states.index_select(0, token_of)  # [T*k, hidden], expert-sorted
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            out_rows[start:end] = self.expert_mlp(expert, rows[start:end])  # [n, hidden]
            start = end
        # Back to pair order, then each token's k outputs weighted and summed. (index_add_ into the
        # tokens measured ~50 ms for 8 rows of 1024 on CPU, a slow scatter_add_ kernel; a gather
        # by the inverse permutation is microseconds.)
        pairs = out_rows.index_select(0, torch.argsort(order)).view(num_tokens, self.top_k, hidden)
        if self.batch_invariant:  # each token's k outputs added in choice order, whatever torch's sum does
            out = pairs[:, 0] * weights[:, :1]
            for choice in range(1, self.top_k):
                out += pairs[:, choice] * weights[:, choice : choice + 1]
            return out
        return (pairs * weights.unsqueeze(-1)).sum(dim=1)

    def forward_dense(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, unchosen ones weighted 0: the benchmark's dense baseline
        (same routing, so the same result up to rounding); this rank's share, unreduced."""
        weights, expert_ids = self.route(hidden_states)
        dense = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=weights.dtype)
        dense.scatter_(1, expert_ids, weights)  # [T, E]
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            out += dense[:, expert : expert + 1] * self.expert_mlp(expert, hidden_states)
        return out

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP over its rows [n, hidden] -> [n, hidden]: through the quantized
        kernel or the packed weights (the compiled CPU GEMM, as the dense linears use; measured
        2-10x faster than F.linear at 1-16 rows per expert) once ``process_weights_after_loading``
        ran."""
        experts = self.experts
        gate_up = experts.project(0, expert, rows)  # [n, 2 * I]
        return experts.project(1, expert, self.act(gate_up))


class _StackedExperts(nn.Module):
    """All experts' weights, stacked: ``w13`` [E, 2*I, hidden] (gate rows, then up rows) and
    ``w2`` [E, hidden, I], I this rank's slice of the intermediate features under tensor
    parallelism. Checkpoints store them per expert; each loads into its slice."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, tp_size: int = 1,
                 tp_rank: int = 0):
        super().__init__()
        intermediate_size //= tp_size
        self.intermediate_size = intermediate_size
        self.tp_rank = tp_rank
        self.full_intermediate_size = intermediate_size * tp_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        # The keys load_weights records per loaded slice (LlamaForCausalLM.expected_weight_keys).
        self.w13.shard_ids = [(e, part) for e in range(num_experts) for part in (0, 1)]
        self.w2.shard_ids = [(e,) for e in range(num_experts)]
        # Per expert, ((gemm, mkl) packed copies of w13[e]), (... of w2[e])); None until packed.
        self.packed: list | None = None
        # Per projection (w13, w2): each expert's QuantizedWeight, or None (float weights).
        self.quant: list[list[QuantizedWeight] | None] = [None, None]
        # Per projection, per expert: GGUF shards still quantized, (row offset, QuantTensor).
        self._staged: list[dict[int, list]] = [{}, {}]
        # Per projection, per expert: its QuantizedWeight, repacked when its last shard came.
        self._ready: list[dict[int, QuantizedWeight]] = [{}, {}]
        self.batch_invariant = batch_invariant.chosen()

    batch_invariant = False  # the mode's kernels: chosen at construction (model/batch_invariant.py)

    def project(self, which: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` times expert ``expert``'s w13 (``which`` 0) or w2 (1), transposed."""
        quant = self.quant[which]
        if self.batch_invariant:  # an expert's row count changes with the batch's routing
            param = (self.w13, self.w2)[which]
            return invariant_matmul(x, None, None if quant is None else quant[expert],
                                    self.packed[expert][which][0], param.shape[1])
        if quant is not None:
            return quant[expert].matmul(x)
        weight = (self.w13, self.w2)[which][expert]
        if self.packed is None:
            return F.linear(x, weight)
        gemm, mkl = self.packed[expert][which]
        return packed_linear(x, weight, None, gemm, mkl)

    @property
    def quantized_nbytes(self) -> int:
        """Bytes of the experts' quantized weights held (0 when they are float)."""
        return sum(q.nbytes for qs in self.quant if qs is not None for q in qs)

    def process_weights_after_loading(self) -> None:
        """Install the experts repacked as they loaded (shards left staged: dequantized), else pack each
        expert's float weights for the CPU GEMM (pack_for_cpu: both None off the CPU or float32, and
        packed_linear then runs F.linear). Call after the last weight/dtype change."""
        for which, param in enumerate((self.w13, self.w2)):
            if self._ready[which]:
                self.quant[which] = _ready_stacked(param, self._ready[which], self._staged[which])
            elif self._staged[which]:
                _finalize_stacked(param, self._staged[which])
            self._staged[which], self._ready[which] = {}, {}
        num_experts = self.w13.shape[0]
        self.packed = [tuple(pack_for_cpu(param[e].detach()) if self.quant[which] is None else (None, None)
                             for which, param in enumerate((self.w13, self.w2)))
                       for e in range(num_experts)]
        if self.batch_invariant and not all(self.quant[which] is not None
                                            or all(packed[which][0] is not None for packed in self.packed)
                                            for which in (0, 1)):
            raise ValueError(NO_INVARIANT_GEMM.format("a mixture-of-experts layer"))

    def _store(self, which: int, param: nn.Parameter, expert: int, row_offset: int, loaded) -> None:
        if isinstance(loaded, QuantTensor):  # kept quantized: repacked once the expert's rows are all here
            if expert in self._ready[which]:
                raise ValueError(f"expert {expert}'s {('gate/up', 'down')[which]} rows were loaded twice")
            shards = self._staged[which].setdefault(expert, [])
            shards.append((row_offset, loaded))
            qtype = _whole(param.shape[1], shards)
            if qtype is not None:
                raw = torch.cat([t.raw for _, t in shards]) if len(shards) > 1 else shards[0][1].raw
                self._ready[which][expert] = QuantizedWeight(qtype, raw, param.shape[2],
                                                             param.__dict__.get("int8_activations", False))
                del self._staged[which][expert]  # the file's bytes go: nothing reads them again
        else:
            target = param.data[expert].narrow(0, row_offset, loaded.shape[0])
            target.copy_(materialize(loaded))

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id  # part 0 = gate_proj [I, hidden], 1 = up_proj
        I = self.intermediate_size
        hidden = param.shape[2]
        assert tuple(loaded.shape) == (self.full_intermediate_size, hidden), (tuple(loaded.shape), hidden)
        # A lazy slice reads only these rows; a QuantTensor's rows stay quantized.
        self._store(0, param, expert, part * I, loaded.narrow(0, self.tp_rank * I, I))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int]) -> None:
        I = self.intermediate_size  # down_proj [hidden, I]: this rank's columns
        hidden = param.shape[1]
        assert tuple(loaded.shape) == (hidden, self.full_intermediate_size), (tuple(loaded.shape), hidden)
        if isinstance(loaded, QuantTensor) and (self.tp_rank * I % quantized.GGUF_BLOCKS[loaded.qtype][0]
                                                or I % quantized.GGUF_BLOCKS[loaded.qtype][0]):
            # A slice that cuts blocks is dequantized, as a dense row-parallel shard is; said once a
            # layer here rather than once per expert by QuantTensor.narrow.
            if shard_id[0] == 0:
                logger.warning("the experts' down columns [%d, %d) cut their %s blocks: dequantized to float32",
                               self.tp_rank * I, (self.tp_rank + 1) * I, quantized.NAMES[loaded.qtype])
            loaded = loaded.materialize()
        self._store(1, param, shard_id[0], 0, loaded.narrow(1, self.tp_rank * I, I))


def _whole(rows: int, shards: list) -> int | None:
    """The one GGUF type of an expert's ``shards`` when they cover its ``rows`` in order and the kernel runs
    here; else None (left staged for ``_finalize_stacked``)."""
    shards.sort(key=lambda s: s[0])
    qtypes = {t.qtype for _, t in shards}
    covered = shards[0][0] == 0 and all(a[0] + a[1].shape[0] == b[0] for a, b in zip(shards, shards[1:]))
    if len(qtypes) == 1 and covered and sum(t.shape[0] for _, t in shards) == rows and quantized.kernel_available():
        return qtypes.pop()
    return None


def _ready_stacked(param: nn.Parameter, ready: dict[int, QuantizedWeight], staged: dict[int, list]) -> list:
    """Every expert's weight repacked as it loaded, the float parameter emptied to ``[E, rows, 0]``. All experts
    of a projection come from one stacked GGUF tensor of one type, so either all are whole or none is."""
    num_experts, rows, _ = param.shape
    if len(ready) != num_experts or staged:
        raise AssertionError(f"{len(ready)} of {num_experts} experts repacked, {len(staged)} still staged")
    param.data = torch.empty(num_experts, rows, 0)
    return [ready[expert] for expert in range(num_experts)]


def _finalize_stacked(param: nn.Parameter, staged: dict[int, list]) -> None:
    """Shards left staged (an expert's were not one type, or no kernel runs here: ``_whole``) dequantized into
    ``param``, which then runs as float32 weights."""
    reason = "mixed shard types" if quantized.kernel_available() else "the compiled kernel is unavailable"
    logger.warning("quantized experts %s dequantized to float32 (%s)", tuple(param.shape), reason)
    for expert, shards in staged.items():
        for offset, shard in shards:
            param.data[expert].narrow(0, offset, shard.shape[0]).copy_(shard.materialize())
    return None
