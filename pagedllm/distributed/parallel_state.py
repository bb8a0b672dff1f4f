"""This process's tensor-parallel group (torch.distributed: gloo on the CPU, NCCL on CUDA).

One group per process, set once by the worker before it builds its model shard. Without
``init_tensor_parallel`` the size is 1, the rank 0, and every collective returns its input.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_group: dist.ProcessGroup | None = None
_size = 1
_rank = 0
_collective_error: BaseException | None = None
"""The first failed collective: a lost peer poisons the group, so later ones fail fast with it."""


def init_tensor_parallel(rank: int, world_size: int, store: dist.Store, timeout_s: float,
                         backend: str = "gloo") -> None:
    """Join the group through ``store`` (a TCPStore shared with every rank). A collective that
    waits longer than ``timeout_s`` for a peer raises instead of hanging."""
    global _group, _size, _rank
    assert _group is None, "tensor parallelism is already initialized in this process"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _group = dist.group.WORLD
    _size, _rank = world_size, rank


def destroy_tensor_parallel() -> None:
    global _group, _size, _rank
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group, _size, _rank = None, 1, 0


def get_tp_size() -> int:
    return _size


def get_tp_rank() -> int:
    return _rank


def take_collective_error() -> BaseException | None:
    """The error of a collective that failed since the last call (the caller must not go on)."""
    global _collective_error
    error, _collective_error = _collective_error, None
    return error


def _run_collective(op) -> None:
    global _collective_error
    if _collective_error is not None:
        raise RuntimeError(f"an earlier collective failed: {_collective_error}")
    try:
        op()
    except Exception as e:  # a peer died or timed out; the step's request isolation must not hide it
        _collective_error = e
        raise


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; a no-op at size 1."""
    if _size == 1:
        return x
    _run_collective(lambda: dist.all_reduce(x, group=_group))
    return x


def tp_all_reduce_in_rank_order(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks as ``((x_0 + x_1) + x_2) + ...`` for every element, whatever ``x``'s
    shape; in place, a no-op at size 1. The batch-invariant mode's reduction (model/batch_invariant.py).

    gloo's ring all-reduce cuts the tensor into one segment per rank and starts each segment's sum at
    a different rank, and the cuts move with the tensor's size: at 3 or more ranks an element's sum
    order, hence its low bits, changes with the number of rows in the step. Two ranks add one pair,
    the same either way round (float addition commutes), so the all-reduce stays; from 3 the ranks
    gather every partial and add them in rank order (tp times the data of a ring all-reduce)."""
    if _size <= 2:
        return tp_all_reduce(x)
    parts = [torch.empty_like(x) for _ in range(_size)]
    _run_collective(lambda: dist.all_gather(parts, x.contiguous(), group=_group))
    x.copy_(parts[0])
    for part in parts[1:]:
        x.add_(part)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); a no-op at size 1."""
    if _size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size)]
    _run_collective(lambda: dist.all_gather(parts, x, group=_group))
    return torch.cat(parts, dim=dim)
