"""`pagedllm bench throughput` and `pagedllm bench serving`: tokens per second offline, latency online.

    pagedllm bench throughput --workload fixed --num-requests 64 --input-len 128 --output-len 128 --hf-batch-size 32
    pagedllm bench serving --rates 0.5,1,2 --policies paged,max
"""

from __future__ import annotations

import math
from pathlib import Path

from pagedllm.bench.common import bench_subparser, float_list, format_table, write_result
from pagedllm.bench.workloads import add_workload_args, make_workload, spec_from_args, trace_stats


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "throughput", bench_throughput,
                        help="engine vs HF generate (static batches) vs HF continuous batching")
    add_workload_args(p)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--hf-max-requests", type=int, default=None, help="run the HF baselines on the first K requests")
    p.add_argument("--no-hf", dest="run_hf", action="store_false", help="skip HF static generate")
    p.add_argument("--no-hf-cb", dest="run_hf_cb", action="store_false", help="skip HF continuous batching")
    p.add_argument("--hf-time-cap", dest="hf_time_cap_s", type=float, default=None,
                   help="stop HF continuous batching after this many seconds; count the tokens streamed by then")
    p.add_argument("--trace-efficiency", action="store_true",
                   help="also compare the engine's wall time with the trace's matmul-only ideal")
    p.add_argument("--name", dest="result_name", default=None, help="result name (default throughput_WORKLOAD)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the engine and HF continuous batching alternately this many times each and report "
                        "every pair's ratio and the median (a shared machine's slow spells last minutes); with "
                        "--trace-efficiency, every engine run's efficiency against one grid")

    p = bench_subparser(subparsers, "serving", bench_serving,
                        help="Poisson arrivals over HTTP against `pagedllm serve`, per policy")
    add_workload_args(p)
    p.add_argument("--rates", default="0.5,1,2", help="request rates (req/s) to sweep; inf = all at once")
    p.add_argument("--policies", default="paged,max")
    p.add_argument("--url", default=None, help="an already running OpenAI-compatible server (skips launching)")


def bench_throughput(args, engine_args: dict) -> dict:
    from pagedllm.bench.plots import plot_throughput
    from pagedllm.bench.throughput import run_throughput, throughput_table

    max_len = engine_args.get("max_model_len") or 2048
    requests = make_workload(spec_from_args(args, 100, max_len))
    result = run_throughput(requests, engine_args, args.hf_batch_size, args.hf_max_requests, args.run_hf,
                            args.run_hf_cb, args.progress, hf_time_cap_s=args.hf_time_cap_s,
                            trace_efficiency=args.trace_efficiency, rounds=args.rounds)
    name = args.result_name or f"throughput_{args.workload}"
    result["workload"] = args.workload
    result["length_scale"] = args.length_scale
    result["engine_args"] = engine_args
    out = Path(args.out)
    write_result(out, name, result)
    plot_throughput(result, out / f"{name}.png", f"{args.workload}: {len(requests)} requests "
                    f"(in {result['trace']['mean_input_len']:.0f}, out {result['trace']['mean_output_len']:.0f} mean)")
    headers, rows = throughput_table(result)
    print(format_table(headers, rows))
    for system, error in result["errors"].items():
        print(f"{system}: not measured: {error}")
    if "rounds" in result:
        from pagedllm.bench.throughput import rounds_table

        print("alternating rounds (the table above is round 1):")
        print(format_table(*rounds_table(result)))
    if "trace_efficiency" in result["systems"][0]:
        from pagedllm.bench.cli_fast_path import print_efficiency

        print_efficiency(result["systems"][0]["trace_efficiency"])
    if "efficiency_rounds" in result:
        from pagedllm.bench.throughput import efficiency_rounds_table

        print("trace efficiency of every round, against the fastest grid timed around all of them:")
        print(format_table(*efficiency_rounds_table(result)))
    return result


def bench_serving(args, engine_args: dict) -> dict:
    from pagedllm.bench.plots import plot_lines
    from pagedllm.bench.serving import run_sweep, serving_table

    max_len = engine_args.get("max_model_len") or 2048
    requests = make_workload(spec_from_args(args, 32, max_len))
    rates = float_list(args.rates)
    flags = serve_args(engine_args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="pagedllm-bench-serve-")  # server logs (named in errors)
    result = run_sweep(requests, rates, [p for p in args.policies.split(",") if p], flags, log_dir,
                       url=args.url, seed=args.workload_seed, progress=args.progress)
    result.update({"workload": args.workload, "trace": trace_stats(requests), "rates": rates,
                   "engine_args": engine_args, "length_scale": args.length_scale})
    write_result(out, f"serving_{args.workload}", result)
    series = {p: ([r["request_rate"] for r in sweep], [r["normalized_latency_s_per_token"]["mean"] or math.nan
                                                       for r in sweep])
              for p, sweep in result["policies"].items()}
    plot_lines(series, out / f"serving_{args.workload}.png", "request rate (req/s)",
               "mean normalized latency (s/token)", f"{args.workload}: {len(requests)} requests per rate", logy=True)
    headers, rows = serving_table(result)
    print(format_table(headers, rows, floatfmt="{:.3f}"))
    return result


def serve_args(engine_args: dict) -> list[str]:
    """The `pagedllm serve` flags that start a server with these engine args (bench serving, hardening,
    data-parallel)."""
    flags = []
    for key, value in engine_args.items():
        if value is None or key in ("model",):
            continue
        if key == "enable_prefix_caching":
            if not value:
                flags.append("--no-prefix-caching")
            continue
        flags += [f"--{key.replace('_', '-')}", str(value)]
    if engine_args.get("model"):
        flags += ["--model", engine_args["model"]]
    return flags
