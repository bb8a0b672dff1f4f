"""Tensor parallelism: the process group, this rank's place in it, and collectives that are
no-ops at size 1 (so the model code is the same sharded or not)."""

from pagedllm.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
    tp_all_gather,
    tp_all_reduce,
)
from pagedllm.distributed.shapes import TPShape, check_tp_size, valid_tp_sizes

__all__ = [
    "TPShape", "check_tp_size", "destroy_tensor_parallel", "get_tp_rank", "get_tp_size",
    "init_tensor_parallel", "tp_all_gather", "tp_all_reduce", "valid_tp_sizes",
]
