"""Device and dtype choice, and the CUDA graphs of decode steps (KV sizing by profiling: kv_cache_sizing.py).

Nothing here runs on the CPU path except ``resolve_device``, ``resolve_dtype`` (and ``DecodeGraphRunner`` with
``capture=False``, which tests use to check the padded static-buffer decode on the CPU).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.forward_context import set_forward_context

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cpu' and 'cuda' (or 'cuda:N') as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return device


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on the CPU (bf16 matmuls are far slower there)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "bf16-matmul":  # float32 tensors; the linears' operands rounded (model/layers/bf16_matmul.py)
        return torch.float32
    if name == "bfloat16" and device.type == "cpu":
        from pagedllm.model.layers.greedy_head import cpu_has_fast_bf16

        if not cpu_has_fast_bf16():
            logger.warning("dtype bfloat16 on a CPU without AMX-BF16 tiles: its bfloat16 matmuls run far slower "
                           "than float32 (up to ~100x); leave dtype auto (float32) for speed")
    return _DTYPES[name]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every 8 up to max_num_seqs (a decode batch pads up to the next one)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphRunner:
    """Decode steps (one token per sequence) through static buffers, replayed as CUDA graphs.

    A batch of n sequences runs at the smallest bucket >= n. Padding rows get slot -1 (the
    KV write skips them) and seq_len 1 over block 0 (read, never written, output dropped).
    The attention backend must launch no data-dependent work (``supports_cuda_graphs``); the
    decode split count is fixed at capture by ``max_seq_len = max_model_len``.
    ``capture=False`` runs the same padded buffers eagerly (CPU tests of the padding logic).
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.slot_mapping = torch.full((max_bs,), -1, **i64)
        self.seq_lens = torch.ones(max_bs, **i64)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, **i64)
        self.query_start_loc = torch.arange(max_bs + 1, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all(device)

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.max_model_len, block_size=self.block_size,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        with set_forward_context(self._metadata(bs), self.kv_caches):
            return self.model(self.input_ids[:bs], self.positions[:bs])

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(bs)  # warm-up: compiles the kernels outside capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (metadata.max_query_len == 1 and metadata.num_seqs <= self.batch_sizes[-1]
                and metadata.block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode step (``can_run`` must hold)."""
        n = metadata.num_seqs
        bs = next(s for s in self.batch_sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        self.block_tables[n:bs].zero_()
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._forward(bs)[:n]
