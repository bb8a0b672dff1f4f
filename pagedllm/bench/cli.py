"""`pagedllm bench ...`: argument parsing and orchestration of each benchmark.

    pagedllm bench throughput --workload fixed --num-requests 64 --input-len 128 --output-len 128 --hf-batch-size 32
    pagedllm bench memory --workload sharegpt --mode both
    pagedllm bench serving --rates 0.5,1,2 --policies paged,max
    pagedllm bench roofline --batch-sizes 1,16,64,128
    pagedllm bench attention
    pagedllm bench sharing --ns 2,4,6 --widths 2,4,6      (KV blocks saved: parallel sampling, beam search)
    pagedllm bench prefix --prefix-lens 80,341            (prefix caching: shared prefix, 0% hit overhead)
    pagedllm bench preemption --block-sizes 8,16,32,64    (swap vs recompute recovery cost)
    pagedllm bench hardening --max-num-waiting 16 --overload 2   (a neighbour of a request at every limit; 2x overload)
    pagedllm bench trace-efficiency --num-requests 64   (engine wall time vs the trace's matmul-only ideal)
    pagedllm bench profile --batch-size 64 --context-len 512   (a decode step: matmuls, attention, other)
    pagedllm bench structured --batch-size 32 --max-tokens 64   (JSON schemas vs free text; grammar compile times)
    pagedllm bench data-parallel --replicas 2   (least-loaded vs prefix-affinity routing; 1 vs 2 replicas)
    pagedllm bench speculative --batch-sizes 1,4,16   (n-gram speculative decoding vs none)
    pagedllm bench all --out docs/bench      (what docs/benchmarks.md is made from)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
from pathlib import Path

from pagedllm.bench.common import format_table, write_result
from pagedllm.bench.workloads import add_workload_args, make_workload, spec_from_args, trace_stats

logger = logging.getLogger(__name__)

# Default model (SmolLM2-135M) KV bytes per token in fp32: 2 (K, V) * 30 layers * 3 KV heads * 64 * 4 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 46080


def _engine_args(args) -> dict:
    from pagedllm.config import EngineArgs

    return dict(vars(EngineArgs.from_cli_args(args)))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _common(p: argparse.ArgumentParser, engine: bool = True) -> None:
    from pagedllm.config import EngineArgs

    p.add_argument("--out", default="bench_results", help="directory for JSON results and PNG plots")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    if engine:
        EngineArgs.add_cli_args(p)


def add_bench_parser(sub) -> None:
    """Add `bench` and its benchmarks to the `pagedllm` command's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks: throughput, memory, serving, roofline, attention, all")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = bsub.add_parser("throughput", help="engine vs HF generate (static batches) vs HF continuous batching")
    _common(p)
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

    p = bsub.add_parser("memory", help="KV memory efficiency: paged vs max / pow2 / oracle reservation")
    _common(p)
    add_workload_args(p)
    p.add_argument("--policies", default="paged,max,pow2,oracle")
    p.add_argument("--allocator", default="first_fit", choices=["first_fit", "buddy"])
    p.add_argument("--mode", default="simulate", choices=["simulate", "real", "both"],
                   help="simulate: scheduler + KV manager only; real: the model runs too (throughput)")
    p.add_argument("--sim-num-requests", type=int, default=None, help="trace size for simulate (default --num-requests)")

    p = bsub.add_parser("serving", help="Poisson arrivals over HTTP against `pagedllm serve`, per policy")
    _common(p)
    add_workload_args(p)
    p.add_argument("--rates", default="0.5,1,2", help="request rates (req/s) to sweep; inf = all at once")
    p.add_argument("--policies", default="paged,max")
    p.add_argument("--url", default=None, help="an already running OpenAI-compatible server (skips launching)")

    p = bsub.add_parser("roofline", help="decode step time vs this machine's bandwidth and matmul ceilings")
    _common(p)
    p.add_argument("--batch-sizes", default="1,16,64,128")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=8)

    p = bsub.add_parser("attention", help="paged attention vs SDPA on contiguous K/V, decode and prefill")
    _common(p, engine=False)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--shapes", default=None, help="phase:seqs:len,... e.g. decode:64:512,prefill:4:256")
    p.add_argument("--kv-cache-dtype", default=None, choices=("float16", "bfloat16"),
                   help="also time each shape over a cache of this type (rows beside float32)")
    p.add_argument("--scattered", nargs="?", type=float, const=2.0, default=None, metavar="GB",
                   help="also time the op over blocks scattered through a cache of GB GiB (default 2), "
                        "a different block set per layer, as the engine reads them")

    p = bsub.add_parser("sharing", help="KV blocks saved by sharing: parallel sampling (n) and beam search (width)")
    _common(p)
    add_workload_args(p)
    # 8 prompts keep it to a couple of minutes; the seed-1 draw of 8 is Alpaca-like (means 18 in, 47 out).
    p.set_defaults(workload="alpaca", workload_seed=1)
    p.add_argument("--ns", default="2,4,6", help="parallel samples per prompt to measure")
    p.add_argument("--widths", default="2,4,6", help="beam widths to measure")

    p = bsub.add_parser("prefix", help="prefix caching on vs off: shared few-shot prefix, and 0%% hit overhead")
    _common(p)
    p.add_argument("--prefix-lens", default="80,341", help="shared prefix lengths (published: ~80 and ~341)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--suffix-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--zero-hit-repeats", type=int, default=5)

    p = bsub.add_parser("preemption", help="recovering a preempted request: swap vs recompute, by block size")
    _common(p)
    p.add_argument("--block-sizes", default="8,16,32,64")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--e2e-num-requests", type=int, default=24, help="requests of the end-to-end comparison")

    from pagedllm.bench.cli_hardening import add_hardening_parser

    add_hardening_parser(bsub, _common)
    from pagedllm.bench.cli_fast_path import add_fast_path_parsers

    add_fast_path_parsers(bsub, _common)
    from pagedllm.bench.structured import add_structured_parser

    add_structured_parser(bsub, _common)
    from pagedllm.bench.data_parallel import add_data_parallel_parser

    add_data_parallel_parser(bsub, _common)
    from pagedllm.bench.speculative import add_speculative_parser

    add_speculative_parser(bsub, _common)

    p = bsub.add_parser("all", help="every benchmark at the sizes docs/benchmarks.md reports")
    _common(p)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a smoke test of the whole pipeline)")
    p.add_argument("--long-trace-requests", type=int, default=200,
                   help="requests of the long ShareGPT-like run to completion (0 skips it; the longest benchmark)")
    p.add_argument("--hf-time-cap", dest="hf_time_cap_s", type=float, default=120.0,
                   help="seconds HF continuous batching runs on the ShareGPT-like traces (tokens counted by then)")
    p.add_argument("--report", default=None, help="also write the markdown report here (docs/benchmarks.md)")


# --- each benchmark ---------------------------------------------------------------------------


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


def bench_memory(args, engine_args: dict) -> dict:
    from pagedllm.bench.memory import memory_table, run_real, simulate, strip_private
    from pagedllm.bench.plots import plot_memory

    policies = [p for p in args.policies.split(",") if p]
    max_len = engine_args.get("max_model_len") or 2048
    block_size = engine_args.get("block_size", 16)
    result = {"workload": args.workload, "length_scale": args.length_scale, "allocator": args.allocator,
              "engine_args": engine_args}
    real_args = {**engine_args, "enable_prefix_caching": False}
    llm = None
    if args.mode in ("real", "both"):
        from pagedllm.bench.engine_utils import build_llm

        llm = build_llm(**real_args)  # paged; sizes the KV cache every policy then shares
        num_blocks = llm.engine.core.kv_info.num_blocks
    elif engine_args.get("num_kv_blocks"):
        num_blocks = engine_args["num_kv_blocks"]
    else:
        from pagedllm.config import parse_memory_size

        num_blocks = parse_memory_size(engine_args["kv_cache_memory"]) // (DEFAULT_KV_BYTES_PER_TOKEN * block_size)
    result["num_kv_blocks"] = num_blocks
    sched_kwargs = dict(block_size=block_size, max_model_len=max_len, max_num_seqs=engine_args["max_num_seqs"],
                        max_num_batched_tokens=engine_args["max_num_batched_tokens"], allocator=args.allocator)
    out = Path(args.out)
    if args.mode in ("simulate", "both"):
        sim_spec = spec_from_args(args, 1000, max_len)
        if args.sim_num_requests:
            sim_spec.num_requests = args.sim_num_requests
        sim_requests = make_workload(sim_spec)
        rows = [simulate(sim_requests, p, num_blocks, progress=args.progress, **sched_kwargs) for p in policies]
        result["simulated"] = {"trace": trace_stats(sim_requests), "rows": rows}
        plot_memory(rows, out / f"memory_{args.workload}_simulated.png",
                    f"{args.workload}, {len(sim_requests)} requests, {num_blocks * block_size} KV slots (simulated)")
        headers, table = memory_table(rows, real=False)
        print(f"simulated: {len(sim_requests)} requests, {num_blocks} blocks of {block_size}")
        print(format_table(headers, table))
    if args.mode in ("real", "both"):
        requests = make_workload(spec_from_args(args, 64, max_len))
        by_policy = {}
        if "paged" in policies:
            by_policy["paged"] = run_real(requests, "paged", llm, progress=args.progress)
        llm = None  # one engine (and KV cache) alive at a time: each baseline gets the paged block count
        gc.collect()
        for p in policies:
            if p != "paged":
                policy_llm = build_llm(p, args.allocator, **{**real_args, "num_kv_blocks": num_blocks})
                by_policy[p] = run_real(requests, p, policy_llm, progress=args.progress)
                del policy_llm
                gc.collect()
        rows = [by_policy[p] for p in policies]
        reference = rows[0]["_outputs"]
        for r in rows:
            r["outputs_match_first_policy"] = r["_outputs"] == reference
        result["real"] = {"trace": trace_stats(requests), "rows": [strip_private(r) for r in rows]}
        plot_memory(rows, out / f"memory_{args.workload}_real.png",
                    f"{args.workload}, {len(requests)} requests, {num_blocks * block_size} KV slots (model runs)")
        headers, table = memory_table(rows, real=True)
        print(f"with the model: {len(requests)} requests, {num_blocks} blocks of {block_size}")
        print(format_table(headers, table))
    write_result(out, f"memory_{args.workload}", result)
    return result


def bench_serving(args, engine_args: dict) -> dict:
    from pagedllm.bench.plots import plot_lines
    from pagedllm.bench.serving import run_sweep, serving_table

    max_len = engine_args.get("max_model_len") or 2048
    requests = make_workload(spec_from_args(args, 32, max_len))
    rates = _floats(args.rates)
    serve_args = _serve_args(engine_args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="pagedllm-bench-serve-")  # server logs (named in errors)
    result = run_sweep(requests, rates, [p for p in args.policies.split(",") if p], serve_args, log_dir,
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


def _serve_args(engine_args: dict) -> list[str]:
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


def bench_roofline(args, engine_args: dict) -> dict:
    from pagedllm.bench.engine_utils import build_llm
    from pagedllm.bench.plots import plot_lines
    from pagedllm.bench.roofline import roofline_table, run_roofline

    batch_sizes = _ints(args.batch_sizes)
    engine_args = {**engine_args, "max_num_seqs": max(engine_args["max_num_seqs"], max(batch_sizes))}
    llm = build_llm(**engine_args)
    result = run_roofline(llm, batch_sizes, args.prompt_len, args.decode_steps, args.progress)
    result["engine_args"] = engine_args
    out = Path(args.out)
    write_result(out, "roofline", result)
    rows = result["rows"]
    plot_lines({"engine decode": ([r["batch_size"] for r in rows], [r["engine_decode_tok_s"] for r in rows]),
                "matmuls alone": ([r["batch_size"] for r in rows],
                                  [r["batch_size"] / r["matmuls_alone_ms"] * 1e3 for r in rows]),
                "roofline ceiling": ([r["batch_size"] for r in rows], [r["ceiling_tok_s"] for r in rows])},
               out / "roofline.png", "batch size", "decode tokens / s",
               f"bandwidth {result['bandwidth_gb_s']:.1f} GB/s, matmul {result['matmul_gflop_s']:.0f} GFLOP/s")
    print(f"bandwidth {result['bandwidth_gb_s']:.2f} GB/s, fp32 matmul {result['matmul_gflop_s']:.1f} GFLOP/s")
    headers, table = roofline_table(result)
    print(format_table(headers, table))
    return result


def bench_attention(args, engine_args: dict | None = None) -> dict:
    from pagedllm.bench.attention import DEFAULT_SHAPES, attention_table, run_attention

    shapes = DEFAULT_SHAPES
    if getattr(args, "shapes", None):
        shapes = [(s.split(":")[0], int(s.split(":")[1]), int(s.split(":")[2])) for s in args.shapes.split(",")]
    result = run_attention(shapes, repeats=args.repeats, progress=args.progress,
                           kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
                           scattered_gb=getattr(args, "scattered", None))
    write_result(Path(args.out), "attention", result)
    headers, table = attention_table(result)
    print(format_table(headers, table))
    return result


# --- all ---------------------------------------------------------------------------------------

# The sizes `bench all` runs (docs/benchmarks.md). Chosen so the whole run fits ~30 minutes on a
# 2-core CPU once the engine reaches its targets (the long ShareGPT-like run is the biggest part:
# --long-trace-requests sizes it); the smoke sizes run the same pipeline in seconds with a tiny model.
# "HF_CAP" and "LONG" are filled in from `bench all`'s --hf-time-cap and --long-trace-requests.
ALL_SIZES = {
    "full": {
        "throughput": [
            # HF static generate is left out at ShareGPT lengths: a batch runs to its longest request
            # (~1800 tokens), tens of minutes here; hf_cb is the baseline.
            dict(workload="sharegpt", num_requests=64, length_scale=1.0, run_hf=False, hf_time_cap_s="HF_CAP",
                 trace_efficiency=True),
            dict(workload="alpaca", num_requests=64, length_scale=1.0, hf_batch_size=32),
            dict(workload="sharegpt", num_requests="LONG", length_scale=1.0, run_hf=False, hf_time_cap_s="HF_CAP",
                 result_name="throughput_sharegpt_long"),
        ],
        # The model run: a small KV budget (2048 slots) so that memory, not the CPU, limits the batch.
        "memory": dict(workload="alpaca", num_requests=24, length_scale=1.0, sim_num_requests=1000,
                       kv_cache_memory=str(2048 * DEFAULT_KV_BYTES_PER_TOKEN), max_model_len=512, mode="both"),
        "memory_sharegpt": dict(workload="sharegpt", sim_num_requests=1000, mode="simulate",
                                kv_cache_memory=str(16384 * DEFAULT_KV_BYTES_PER_TOKEN), max_model_len=2048),
        "serving": dict(workload="alpaca", num_requests=12, length_scale=0.5, rates="1,4", policies="paged,max",
                        kv_cache_memory=str(2048 * DEFAULT_KV_BYTES_PER_TOKEN), max_model_len=512),
        "roofline": dict(batch_sizes="1,16,64", prompt_len=64, decode_steps=4),
        "profile": dict(batch_size=64, context_len=512, decode_steps=5, torch_profiler=True),
        "attention": dict(repeats=5),
        "sharing": dict(workload="alpaca", workload_seed=1, num_requests=8, ns="2,4,6", widths="2,4,6"),
        "prefix": dict(prefix_lens="80,341", num_requests=32, output_len=32, zero_hit_repeats=5),
        "preemption": dict(block_sizes="8,16,32,64", context_len=512, repeats=5),
    },
}


def bench_sharing(args, engine_args: dict) -> dict:
    from pagedllm.bench.engine_utils import build_llm
    from pagedllm.bench.sharing import run_sharing, sharing_table

    max_len = engine_args.get("max_model_len") or 2048
    requests = make_workload(spec_from_args(args, 8, max_len))
    llm = build_llm(**engine_args)
    result = run_sharing(llm, requests, _ints(args.ns), _ints(args.widths), args.progress)
    result.update({"workload": args.workload, "length_scale": args.length_scale, "engine_args": engine_args})
    write_result(Path(args.out), f"sharing_{args.workload}", result)
    trace = result["trace"]
    print(f"{args.workload}: {trace['num_requests']} prompts, mean input {trace['mean_input_len']:.1f}, "
          f"mean output {trace['mean_output_len']:.1f} tokens, blocks of {result['block_size']}")
    headers, rows = sharing_table(result)
    print(format_table(headers, rows, floatfmt="{:.1f}"))
    return result


def bench_prefix(args, engine_args: dict) -> dict:
    from pagedllm.bench.prefix_cache import prefix_tables, run_shared_prefix, run_zero_hit

    result = run_shared_prefix(engine_args, _ints(args.prefix_lens), args.num_requests, args.suffix_len,
                               args.output_len)
    result.update(run_zero_hit(engine_args, num_requests=max(4, args.num_requests // 2), output_len=args.output_len,
                               repeats=args.zero_hit_repeats))
    write_result(Path(args.out), "prefix_cache", result)
    print(prefix_tables(result))
    return result


def bench_preemption(args, engine_args: dict) -> dict:
    from pagedllm.bench.preemption import end_to_end, preemption_tables, recovery_cost

    result = {
        "recovery": recovery_cost(tuple(_ints(args.block_sizes)), args.context_len, args.repeats,
                                  model=engine_args.get("model")),
        "end_to_end": end_to_end(num_requests=args.e2e_num_requests, model=engine_args.get("model"),
                                 output_len=96 if args.e2e_num_requests >= 8 else 8),
    }
    write_result(Path(args.out), "preemption", result)
    print(preemption_tables(result["recovery"], result["end_to_end"]))
    return result


def bench_all(args, engine_args: dict) -> dict:
    base = vars(args).copy()

    def ns(**overrides) -> argparse.Namespace:
        d = {**base, "workload": "sharegpt", "num_requests": None, "input_len": 128, "output_len": 128,
             "prefix_len": 256, "length_scale": 1.0, "n": 1, "workload_seed": 0, "hf_batch_size": 32,
             "hf_max_requests": None, "run_hf": True, "run_hf_cb": True, "policies": "paged,max,pow2,oracle",
             "allocator": "first_fit", "mode": "both", "sim_num_requests": None, "rates": "1",
             "url": None, "batch_sizes": "1,16,64", "prompt_len": 64, "decode_steps": 8, "repeats": 5,
             "shapes": None, "ns": "2,4,6", "widths": "2,4,6", "prefix_lens": "80,341", "suffix_len": 24,
             "zero_hit_repeats": 5, "block_sizes": "8,16,32,64", "context_len": 512,
             "e2e_num_requests": 24, "hf_time_cap_s": None, "trace_efficiency": False, "result_name": None, "rounds": 1,
             "batch_size": 64, "torch_profiler": False}
        d.update(overrides)
        return argparse.Namespace(**d)

    sizes = ALL_SIZES["full"]
    if args.smoke:
        sizes = smoke_sizes()
    knobs = {"HF_CAP": args.hf_time_cap_s, "LONG": args.long_trace_requests}
    if args.smoke:
        knobs = {"HF_CAP": min(args.hf_time_cap_s, 2.0), "LONG": min(args.long_trace_requests, 6)}
    results = {}
    for t in sizes["throughput"]:
        t = {k: knobs.get(v, v) if isinstance(v, str) else v for k, v in t.items()}
        if t["num_requests"] == 0:
            continue
        name = t.get("result_name") or f"throughput_{t['workload']}"
        results[name] = bench_throughput(ns(**t), engine_args)
        efficiency = results[name]["systems"][0].get("trace_efficiency")
        if efficiency:
            results["trace_efficiency"] = {"workload": t["workload"], "trace": results[name]["trace"], **efficiency}
    for key in ("memory", "memory_sharegpt"):
        m = dict(sizes[key])
        ea = _with_memory(engine_args, m)
        results[key] = bench_memory(ns(**m), ea)
    s = dict(sizes["serving"])
    ea = _with_memory(engine_args, s)
    try:
        results["serving"] = bench_serving(ns(**s), ea)
    except Exception as e:  # the server is a separate component: report, do not lose the other results
        logger.exception("serving benchmark failed")
        results["serving"] = {"error": f"{type(e).__name__}: {e}"}
    results["roofline"] = bench_roofline(ns(**sizes["roofline"]), engine_args)
    from pagedllm.bench.cli_fast_path import bench_profile

    results["profile"] = bench_profile(ns(**sizes["profile"]), engine_args)
    results["attention"] = bench_attention(ns(**sizes["attention"]))
    for key, bench in (("sharing", bench_sharing), ("prefix", bench_prefix), ("preemption", bench_preemption)):
        if key in sizes:
            results[key] = bench(ns(**sizes[key]), engine_args)
    summary = Path(args.out) / "summary.json"
    summary.write_text(json.dumps({k: sorted(v) if isinstance(v, dict) else None for k, v in results.items()},
                                  indent=1) + "\n")
    if args.report:
        import shlex
        import sys

        from pagedllm.bench.report import write_report

        command = "pagedllm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        print(f"report: {write_report(results, Path(args.out), Path(args.report), command)}")
    return results


def _with_memory(engine_args: dict, sizes: dict) -> dict:
    """engine_args with the benchmark's own KV budget and max_model_len (None keeps the given ones)."""
    ea = dict(engine_args)
    for key in ("kv_cache_memory", "max_model_len"):
        value = sizes.pop(key, None)
        if value is not None:
            ea[key] = value
    return ea


def smoke_sizes() -> dict:
    return {
        "prefix": dict(prefix_lens="16", num_requests=4, suffix_len=4, output_len=2, zero_hit_repeats=1),
        "preemption": dict(block_sizes="8,16", context_len=32, repeats=1, e2e_num_requests=4),
        "throughput": [
            dict(workload="alpaca", num_requests=4, length_scale=0.2, hf_batch_size=2),
            dict(workload="sharegpt", num_requests=4, length_scale=0.05, run_hf=False, hf_time_cap_s="HF_CAP",
                 trace_efficiency=True),
            dict(workload="sharegpt", num_requests="LONG", length_scale=0.05, run_hf=False, hf_time_cap_s="HF_CAP",
                 result_name="throughput_sharegpt_long"),
        ],
        "profile": dict(batch_size=4, context_len=32, decode_steps=2, torch_profiler=True),
        "memory": dict(workload="alpaca", num_requests=4, length_scale=0.3, sim_num_requests=50,
                       kv_cache_memory=None, max_model_len=None, mode="both"),
        "memory_sharegpt": dict(workload="sharegpt", sim_num_requests=50, length_scale=0.05,
                                kv_cache_memory=None, max_model_len=None, mode="simulate"),
        "serving": dict(workload="alpaca", num_requests=3, length_scale=0.2, rates="inf", policies="paged",
                        kv_cache_memory=None, max_model_len=None),
        "roofline": dict(batch_sizes="1,4", prompt_len=8, decode_steps=3),
        "attention": dict(repeats=1, shapes="decode:2:32,prefill:1:32"),
    }


def run_bench(args) -> int:
    from pagedllm.bench.cli_fast_path import bench_profile, bench_trace_efficiency
    from pagedllm.bench.cli_hardening import bench_hardening
    from pagedllm.bench.structured import bench_structured
    from pagedllm.bench.data_parallel import bench_data_parallel
    from pagedllm.bench.speculative import bench_speculative

    engine_args = _engine_args(args) if hasattr(args, "block_size") else {}
    commands = {"throughput": bench_throughput, "memory": bench_memory, "serving": bench_serving,
                "roofline": bench_roofline, "attention": bench_attention, "sharing": bench_sharing,
                "prefix": bench_prefix, "preemption": bench_preemption, "hardening": bench_hardening,
                "all": bench_all, "trace-efficiency": bench_trace_efficiency, "profile": bench_profile,
                "structured": bench_structured,
                "data-parallel": bench_data_parallel,
                "speculative": bench_speculative}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    commands[args.bench_command](args, engine_args)
    print(f"results in {Path(args.out).resolve()}")
    return 0
