"""`pagedllm serve` over a chosen KV allocation policy: the server `bench serving` starts per policy.

    python -m pagedllm.bench.baseline_server --kv-allocation-policy max [--kv-allocator buddy] [serve flags]

The policy reaches the engine core (in its own process) through EngineCore's one injection point,
so the product's `serve` command knows nothing of benchmark baselines.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pagedllm.bench.contiguous_allocator import CONTIGUOUS_ALLOCATORS, KV_ALLOCATION_POLICIES, kv_cache_manager_factory
from pagedllm.core.kv_cache_interface import plugged_kv_cache_manager


def main(argv: list[str] | None = None) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server
    from pagedllm.entrypoints.openai.cli_args import add_serve_args, configs_from_args

    parser = argparse.ArgumentParser(prog="python -m pagedllm.bench.baseline_server")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--kv-allocation-policy", default="paged", choices=KV_ALLOCATION_POLICIES)
    parser.add_argument("--kv-allocator", default="first_fit", choices=CONTIGUOUS_ALLOCATORS,
                        help="placement of contiguous reservations (non-paged policies)")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_args, config = configs_from_args(args)
    factory = kv_cache_manager_factory(args.kv_allocation_policy, args.kv_allocator)
    with plugged_kv_cache_manager(factory):  # the engine-core process spawned by the server inherits it
        asyncio.run(run_server(engine_args, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
