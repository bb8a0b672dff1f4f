"""Attention backends behind one interface: the PyTorch reference ("torch"), the compiled CPU op
("cpu", ``csrc/`` via ``cpu_op``) and Triton kernels ("triton").

All read and write the same KV layout, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
per layer, so a cache filled by one is read correctly by the other. Each ``Attention`` layer holds
a backend (the torch reference unless the model runner sets another with
``layer.set_attention_backend``); triton is imported only when its backend is built, so CPU-only
installs without triton never touch it.

Two per-layer options reach ``attend`` from the ``Attention`` layer: ``sliding_window`` and
``softcap`` (paged.py defines both). The reference implements both; so does the compiled CPU op
(``window=-1`` / ``softcap=0`` = none); the Triton kernels take
neither, and ``layer.set_attention_backend`` refuses a model that needs them there.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pagedllm.model import batch_invariant as batch_invariant_mode
from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.attention.paged import paged_attention, write_kv_cache

BACKENDS = ("auto", "torch", "cpu", "triton")


class AttentionBackend:
    """Writes a step's K/V into the paged cache, then attends through the block tables."""

    name = "base"
    supports_cuda_graphs = False
    """True when a decode step launches no host-synchronizing or data-dependent-shape work."""

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    supports_sliding_window = True
    supports_softcap = True

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """``write_kv_cache`` then ``forward``: what an ``Attention`` layer calls once per step (a
        backend may do both behind one check)."""
        self.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return self.forward(query, kv_cache, metadata, scale, sliding_window, softcap)


class TorchAttentionBackend(AttentionBackend):
    """The CPU reference (``paged.py``): gather through block tables, masked SDPA."""

    name = "torch"

    def write_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        write_kv_cache(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, metadata, scale, sliding_window=None, softcap=None) -> torch.Tensor:
        return paged_attention(query, kv_cache, metadata, scale, sliding_window, softcap)


class CpuAttentionBackend(AttentionBackend):
    """The compiled CPU op: one varlen call reads K/V blocks in place for every step (decode rows,
    prompt chunks over a cached prefix, and both mixed).

    Long chunks take the op's tiled path (gathered key tiles, register-blocked micro-GEMMs),
    which measured faster than torch's SDPA on the same chunk (so no chunk is routed to SDPA, and
    a mixed step costs about its decode part plus its chunk). Inputs the op does not cover
    (another dtype, an uncompiled head_dim) go to the reference.
    """

    name = "cpu"

    def __init__(self, batch_invariant: bool = False):
        from pagedllm.model.attention import cpu_op

        self._op = cpu_op
        # The ops' C++ callables, bound once (None where the library is not loaded): calling them
        # skips cpu_op's wrappers and OpOverload.__call__, two Python frames per call.
        self._kv_write = self._attention = None
        if cpu_op.load():
            ns = torch.ops.pagedllm
            self._kv_write = getattr(ns.kv_write_cpu.default, "_op", ns.kv_write_cpu.default)
            self._attention = getattr(ns.paged_attention_cpu.default, "_op", ns.paged_attention_cpu.default)
        self.batch_invariant = batch_invariant
        """The batch-invariant mode (model/batch_invariant.py): no context splits, every row on the per-key path."""
        if batch_invariant and self._attention is None:
            raise ValueError(f"batch_invariant needs the compiled CPU attention op ({cpu_op.unavailable_reason()})")
        # paged_attention_cpu's (num_splits, tile_min_rows): 0 = the op's defaults; the mode fixes both.
        self.split_args = ((batch_invariant_mode.ATTENTION_NUM_SPLITS, batch_invariant_mode.ATTENTION_TILE_MIN_ROWS)
                           if batch_invariant else (0, 0))

    @property
    def compiled(self) -> bool:
        """Whether the compiled op is loaded (else every call goes to the torch reference)."""
        return self._attention is not None

    def attend(self, query, key, value, kv_cache, metadata, scale, sliding_window=None, softcap=None) -> torch.Tensor:
        # Both ops' conditions (cpu_op.supports_kv_write and cpu_op.supports) checked once, with the
        # cheapest tensor reads (is_cpu, not .device): at decode these checks were ~5 us a layer.
        f32 = torch.float32
        if (self._attention is not None and query.dtype == f32 and key.dtype == f32 and value.dtype == f32
                and query.is_cpu and key.is_cpu and kv_cache.dtype in self._op.KV_DTYPES
                and kv_cache.is_contiguous() and query.shape[-1] in self._op.SUPPORTED_HEAD_DIMS
                and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1):
            self._kv_write(key, value, kv_cache, metadata.slot_mapping)
            splits, tile_min_rows = self.split_args
            return self._attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                   metadata.query_start_loc, scale, splits, 0, tile_min_rows, 0,
                                   -1 if sliding_window is None else sliding_window,
                                   0.0 if softcap is None else softcap)
        self.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return self.forward(query, kv_cache, metadata, scale, sliding_window, softcap)

    def write_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        # The op copies the strided K/V views row by row; index_copy_ measured ~3x slower per call.
        if self._op.supports_kv_write(key, value, kv_cache):
            self._op.kv_write_cpu(key, value, kv_cache, slot_mapping)
        else:
            write_kv_cache(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, metadata, scale, sliding_window=None, softcap=None) -> torch.Tensor:
        if not self._op.supports(query, kv_cache):
            return paged_attention(query, kv_cache, metadata, scale, sliding_window, softcap)
        return self._op.paged_attention_cpu(query, kv_cache, metadata, scale, sliding_window=sliding_window,
                                            softcap=softcap)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels: slot-mapped KV write, paged decode (split-K for long contexts), varlen prefill.

    ``num_splits`` / ``block_n`` / ``block_m`` override the defaults (tests use small tiles so
    that short sequences still span several tiles and exercise the split path).
    """

    name = "triton"
    supports_cuda_graphs = True
    # Neither mask nor cap is in the kernels yet; layer.set_attention_backend refuses such models here.
    supports_sliding_window = False
    supports_softcap = False

    def __init__(self, num_splits: int | None = None, block_n: int | None = None, block_m: int | None = None):
        from pagedllm.model.attention import triton_decode, triton_kv_write, triton_prefill

        self._decode = triton_decode
        self._prefill = triton_prefill
        self._write = triton_kv_write
        self.num_splits = num_splits
        self.block_n = block_n
        self.block_m = block_m
        self._num_sms: int | None = None

    def write_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        self._write.triton_write_kv_cache(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, metadata, scale, sliding_window=None, softcap=None) -> torch.Tensor:
        if sliding_window is not None or softcap is not None:
            raise NotImplementedError("the triton attention backend has no sliding window or soft-capping")
        if metadata.max_query_len == 1:  # decode only: one query per sequence
            num_splits = self.num_splits or self._decode.default_num_splits(
                metadata.num_seqs, kv_cache.shape[3], metadata.max_seq_len, self._sm_count(query.device)
            )
            return self._decode.triton_paged_decode(
                query, kv_cache, metadata.block_tables, metadata.seq_lens, scale,
                num_splits=num_splits, block_n=self.block_n or 64,
            )
        return self._prefill.triton_paged_prefill(
            query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            metadata.max_query_len, scale, block_m=self.block_m or 64, block_n=self.block_n or 64,
        )

    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else 8)
        return self._num_sms


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def cpu_op_available() -> bool:
    from pagedllm.model.attention import cpu_op

    return cpu_op.load()


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """'auto' -> 'triton' on CUDA when triton is installed, 'cpu' on the CPU when the compiled op
    loaded, else 'torch'. Raises on a bad choice."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if device.type == "cpu" and cpu_op_available() else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend='cpu' runs on the CPU only")
        if not cpu_op_available():
            from pagedllm.model.attention import cpu_op

            raise ValueError(f"attention_backend='cpu': the compiled op is unavailable "
                             f"({cpu_op.unavailable_reason()}); use 'torch' or 'auto'")
    if name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the 'triton' package; install it or use 'torch'")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' on the CPU runs only under TRITON_INTERPRET=1 (slow; "
                             "for tests); use 'torch'")
    return name


def make_attention_backend(name: str, device: torch.device | str = "cpu",
                           batch_invariant: bool = False) -> AttentionBackend:
    """The backend called ``name`` ('auto', 'torch', 'cpu' or 'triton') for ``device``; ``batch_invariant``: with
    the mode's split and path choices (the compiled CPU op only; ValueError for another)."""
    resolved = resolve_backend_name(name, device)
    if batch_invariant and resolved != "cpu":
        raise ValueError("batch_invariant needs the compiled CPU attention op (attention_backend 'cpu' or "
                         f"'auto' on the CPU with the library built); got {resolved!r}")
    if resolved == "triton":
        return TritonAttentionBackend()
    return CpuAttentionBackend(batch_invariant) if resolved == "cpu" else TORCH_BACKEND


TORCH_BACKEND = TorchAttentionBackend()
