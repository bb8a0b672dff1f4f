"""One rank of the rank-order all-reduce check in test_batch_invariant_tp.py. Its own module, importing
only torch and parallel_state: each spawned rank imports the module of its target, and the test module
would cost every rank the imports of the engine and transformers (seconds apiece)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

ROW_COUNTS = (1, 2, 3, 5, 17, 64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reduce_rank(rank: int, world_size: int, port: int, results) -> None:
    from pagedllm.distributed import parallel_state as ps

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=60))
    ps.init_tensor_parallel(rank, world_size, store, timeout_s=60)
    try:
        # Partials of widely different magnitudes: most orders of three or more sums round differently.
        partials = torch.randn(64, 576, generator=torch.Generator().manual_seed(rank)) * torch.logspace(-3, 3, 576)
        first_rows = {}
        for name, reduce in (("ring", ps.tp_all_reduce), ("rank order", ps.tp_all_reduce_in_rank_order)):
            first_rows[name] = [reduce(partials[:rows].clone())[0] for rows in ROW_COUNTS]
        if rank == 0:
            everyone = [torch.randn(64, 576, generator=torch.Generator().manual_seed(r)) * torch.logspace(-3, 3, 576)
                        for r in range(world_size)]
            expected = everyone[0][0].clone()
            for other in everyone[1:]:
                expected += other[0]
            results.put({name: [bool(torch.equal(row, expected)) for row in rows]
                         for name, rows in first_rows.items()})
    finally:
        ps.destroy_tensor_parallel()
