"""`pagedllm bench ...`: one subcommand per benchmark, each declared by its own module, and `bench all`.

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
    pagedllm bench tools --repeats 5 --max-tokens 64   (TTFT, decode tok/s: free text vs JSON schema vs tool calls)
    pagedllm bench agent-apis --rounds 5 --concurrency 4   (streamed tok/s: /v1/responses, /v1/messages vs chat)
    pagedllm bench accuracy   (quantized kernels vs float32 and float64 per layer shape; perplexity per weight path)
    pagedllm bench moe --batch-sizes 1,16,64   (MoE decode: grouped experts vs all experts dense vs the ideal)
    pagedllm bench llamacpp --rounds 5 --concurrency 64   (beside llama.cpp's server on the same GGUF)
    pagedllm bench serve-memory --burst 16   (resident memory of each server process: ready, 1 request, a burst)
    pagedllm bench kv-disk --prefix-len 8000   (the KV disk tier: time to first token after eviction and restart)
    pagedllm bench embed --shapes minilm,qwen3-0.6b   (embeddings/s and rerank pairs/s beside sentence-transformers)
    pagedllm bench embed-mixed --rounds 2   (a generation load slowed by embedding requests in its engine)
    pagedllm bench quant-gemm --threads 1   (the compiled quantized kernels side by side: ms per call, GB/s)
    pagedllm bench bf16-error --shape minilm   (which bfloat16 rounding moves an embedder's vectors)
    pagedllm bench all --out docs/bench --report docs/bench/results.md   (what `make bench` runs)

Each module in BENCHMARK_MODULES has `add_parser(subparsers)`, which declares its subcommands' arguments on
`common.bench_subparser(...)` and names the function that runs each. `bench all` runs them at the sizes below,
on arguments parsed by those same parsers (a size naming an argument its benchmark lacks is an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
from pathlib import Path

from pagedllm.bench.cli_memory import DEFAULT_KV_BYTES_PER_TOKEN
from pagedllm.bench.common import bench_subparser
from pagedllm.config import EngineArgs

logger = logging.getLogger(__name__)

BENCHMARK_MODULES = (
    "pagedllm.bench.cli_throughput",  # throughput, serving
    "pagedllm.bench.cli_memory",  # memory, sharing, prefix, preemption
    "pagedllm.bench.cli_fast_path",  # trace-efficiency, profile, roofline, attention
    "pagedllm.bench.cli_hardening",  # hardening
    "pagedllm.bench.structured",
    "pagedllm.bench.data_parallel",
    "pagedllm.bench.speculative",
    "pagedllm.bench.tools",
    "pagedllm.bench.agent_apis",  # agent-apis (not in `bench all`)
    "pagedllm.bench.accuracy",
    "pagedllm.bench.moe",
    "pagedllm.bench.cli_llamacpp",  # llamacpp (not in `bench all`)
    "pagedllm.bench.serve_memory",  # serve-memory (not in `bench all`)
    "pagedllm.bench.kv_disk",  # kv-disk (not in `bench all`)
    "pagedllm.bench.embed",  # embed (not in `bench all`)
    "pagedllm.bench.embed_mixed",  # embed-mixed (not in `bench all`)
    "pagedllm.bench.quant_gemm",  # quant-gemm (not in `bench all`)
    "pagedllm.bench.bf16_error",  # bf16-error (not in `bench all`)
)
"""Modules light enough to import when the CLI starts (no torch at import); each declares its subcommands."""


def add_bench_parser(sub) -> None:
    """Add `bench` and its benchmarks to the `pagedllm` command's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks: throughput, memory, serving, roofline, attention, all")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name in BENCHMARK_MODULES:
        importlib.import_module(name).add_parser(bsub)

    p = bench_subparser(bsub, "all", bench_all, help="every benchmark at the sizes docs/bench/results.md reports")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a smoke test of the whole pipeline)")
    p.add_argument("--long-trace-requests", type=int, default=200,
                   help="requests of the long ShareGPT-like run to completion (0 skips it; the longest benchmark)")
    p.add_argument("--hf-time-cap", dest="hf_time_cap_s", type=float, default=120.0,
                   help="seconds HF continuous batching runs on the ShareGPT-like traces (tokens counted by then)")
    p.add_argument("--report", default=None,
                   help="also write the generated results page here (make bench: docs/bench/results.md); an "
                        "existing file is replaced only if this command generated it")


def benchmark_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each benchmark's parser by subcommand name (what `bench all` parses its arguments with)."""
    bsub = argparse.ArgumentParser().add_subparsers()
    for name in BENCHMARK_MODULES:
        importlib.import_module(name).add_parser(bsub)
    return dict(bsub.choices)


# The sizes `bench all` runs (docs/bench/results.md). Chosen so the whole run fits ~30 minutes on a
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


def bench_all(args, engine_args: dict) -> dict:
    from pagedllm.bench.cli_fast_path import bench_attention, bench_profile, bench_roofline
    from pagedllm.bench.cli_memory import bench_memory, bench_preemption, bench_prefix, bench_sharing
    from pagedllm.bench.cli_throughput import bench_serving, bench_throughput
    from pagedllm.bench.report import check_writable

    if args.report:
        check_writable(Path(args.report))  # before the hours of measuring, not after
    parsers = benchmark_parsers()
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}

    def ns(name: str, **sizes) -> argparse.Namespace:
        """`bench NAME`'s arguments: its parser's defaults, this run's --out, --no-progress and engine flags,
        then `sizes`, each of which must be one of its arguments."""
        sub = parsers[name].parse_args([])
        unknown = sorted(set(sizes) - set(vars(sub)))
        if unknown:
            raise ValueError(f"bench all: `bench {name}` has no argument {', '.join(unknown)}")
        inherited = {"out", "progress", *(engine_fields if "block_size" in vars(sub) else ())}
        vars(sub).update({k: v for k, v in vars(args).items() if k in inherited})
        vars(sub).update(sizes)
        return sub

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
        results[name] = bench_throughput(ns("throughput", **t), engine_args)
        efficiency = results[name]["systems"][0].get("trace_efficiency")
        if efficiency:
            results["trace_efficiency"] = {"workload": t["workload"], "trace": results[name]["trace"], **efficiency}
    for key in ("memory", "memory_sharegpt"):
        m = dict(sizes[key])
        ea = _with_memory(engine_args, m)
        results[key] = bench_memory(ns("memory", **m), ea)
    s = dict(sizes["serving"])
    ea = _with_memory(engine_args, s)
    try:
        results["serving"] = bench_serving(ns("serving", **s), ea)
    except Exception as e:  # the server is a separate component: report, do not lose the other results
        logger.exception("serving benchmark failed")
        results["serving"] = {"error": f"{type(e).__name__}: {e}"}
    results["roofline"] = bench_roofline(ns("roofline", **sizes["roofline"]), engine_args)
    results["profile"] = bench_profile(ns("profile", **sizes["profile"]), engine_args)
    results["attention"] = bench_attention(ns("attention", **sizes["attention"]))
    for key, bench in (("sharing", bench_sharing), ("prefix", bench_prefix), ("preemption", bench_preemption)):
        if key in sizes:
            results[key] = bench(ns(key, **sizes[key]), engine_args)
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
    engine_args = dict(vars(EngineArgs.from_cli_args(args))) if hasattr(args, "block_size") else {}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.run(args, engine_args)
    print(f"results in {Path(args.out).resolve()}")
    return 0
