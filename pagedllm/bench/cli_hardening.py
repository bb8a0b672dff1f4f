"""`pagedllm bench hardening`: an ordinary request beside one at every limit, and 2x overload with 429s.

    pagedllm bench hardening --max-num-waiting 16 --overload 2
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.bench.common import bench_subparser, write_result


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "hardening", bench_hardening,
                        help="an ordinary request beside one at every limit; 2x overload with 429s")
    p.add_argument("--url", default=None, help="an already running server (skips launching)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-num-waiting", type=int, default=16, help="the launched server's waiting-queue bound")
    p.add_argument("--overload", type=float, default=2.0, help="offered load as a multiple of capacity")
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds of overloaded arrivals")
    p.add_argument("--burst", type=int, default=32, help="requests in flight when measuring capacity")
    p.add_argument("--repeats", type=int, default=5, help="ordinary requests timed alone and beside")
    p.add_argument("--limit-n", type=int, default=64, help="n of the request at every limit (x 4 prompts)")
    # The defaults sit exactly at the engine's RequestLimits defaults (max_stop_token_ids,
    # max_logit_bias; 4 prompts x n=64 = max_sequences_per_request).
    p.add_argument("--limit-stop-token-ids", type=int, default=256)
    p.add_argument("--limit-logit-bias", type=int, default=300)


def bench_hardening(args, engine_args: dict) -> dict:
    import tempfile

    from pagedllm.bench.cli_throughput import serve_args
    from pagedllm.bench.hardening import Limits, hardening_tables, run_hardening
    from pagedllm.bench.serving import ServerProcess

    limits = Limits(num_stop_token_ids=args.limit_stop_token_ids, num_logit_bias=args.limit_logit_bias, n=args.limit_n)
    server = None
    url = args.url
    if url is None:
        log = tempfile.mkstemp(prefix="pagedllm-bench-hardening-", suffix=".log")[1]
        server = ServerProcess([*serve_args(engine_args), "--max-num-waiting", str(args.max_num_waiting)], log)
        url = server.url
    try:
        result = run_hardening(url, limits, args.repeats, args.overload, args.duration_s, args.burst, args.api_key)
    finally:
        if server is not None:
            server.stop()
    result.update({"engine_args": engine_args, "max_num_waiting": args.max_num_waiting if args.url is None else None})
    write_result(Path(args.out), "hardening", result)
    print(hardening_tables(result))
    return result
