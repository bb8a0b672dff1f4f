"""How close a step gets to its matmuls: `pagedllm bench trace-efficiency`, `profile`, `roofline`, `attention`.

    pagedllm bench trace-efficiency --workload sharegpt --num-requests 64     (wall vs matmul-only ideal)
    pagedllm bench profile --batch-size 64 --context-len 512                  (a decode step's time by part)
    pagedllm bench roofline --batch-sizes 1,16,64,128     (decode vs this machine's bandwidth and matmul ceilings)
    pagedllm bench attention                              (paged attention vs SDPA on contiguous K/V)
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, int_list, write_result
from pagedllm.bench.workloads import add_workload_args, make_workload, spec_from_args


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "trace-efficiency", bench_trace_efficiency,
                        help="engine wall time on a trace vs its matmul-only ideal")
    add_workload_args(p)
    p.set_defaults(num_requests=64)

    p = bench_subparser(subparsers, "profile", bench_profile,
                        help="a decode step's time: matmuls, attention, everything else")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=5, help="decode steps timed (without hooks, then with)")
    p.add_argument("--torch-profiler", action="store_true", help="also write torch.profiler's top ops")
    p.add_argument("--compare-fused-ops", action="store_true",
                   help="also time steps with the fused small CPU ops (norms, rotary, SiLU) off, alternating "
                        "with the steps with them on, and report both")
    p.add_argument("--compare-op-pool", action="store_true",
                   help="also time steps with the compiled ops' spinning worker threads off (torch's passive "
                        "OpenMP threads instead), alternating with the steps with them on, and report both")

    p = bench_subparser(subparsers, "roofline", bench_roofline,
                        help="decode step time vs this machine's bandwidth and matmul ceilings")
    p.add_argument("--batch-sizes", default="1,16,64,128")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=8)

    p = bench_subparser(subparsers, "attention", bench_attention, engine=False,
                        help="paged attention vs SDPA on contiguous K/V, decode and prefill")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--shapes", default=None, help="phase:seqs:len,... e.g. decode:64:512,prefill:4:256")
    p.add_argument("--kv-cache-dtype", default=None, choices=("float16", "bfloat16"),
                   help="also time each shape over a cache of this type (rows beside float32)")
    p.add_argument("--scattered", nargs="?", type=float, const=2.0, default=None, metavar="GB",
                   help="also time the op over blocks scattered through a cache of GB GiB (default 2), "
                        "a different block set per layer, as the engine reads them")


def bench_trace_efficiency(args, engine_args: dict) -> dict:
    from pagedllm.bench.engine_utils import build_llm
    from pagedllm.bench.throughput import run_engine
    from pagedllm.bench.workloads import trace_stats

    max_len = engine_args.get("max_model_len") or 2048
    requests = make_workload(spec_from_args(args, 64, max_len))
    engine = run_engine(build_llm(**engine_args), requests, args.progress, trace_efficiency=True)
    result = {"workload": args.workload, "length_scale": args.length_scale, "trace": trace_stats(requests),
              "engine_args": engine_args, "engine_output_tok_s": engine["output_tok_s"], **engine["trace_efficiency"]}
    write_result(Path(args.out), f"trace_efficiency_{args.workload}", result)
    print_efficiency(result)
    return result


def print_efficiency(result: dict) -> None:
    from pagedllm.bench.trace_efficiency import efficiency_table

    print(f"engine {result['engine_wall_s']:.1f} s, matmul-only ideal {result['ideal_s']:.1f} s: efficiency "
          f"{100 * result['efficiency']:.1f}%, {result['num_preemptions']} preemptions")
    if "kv_read_s" in result:
        print(f"KV-read floor {result['kv_read_s']:.1f} s ({result['read_gb_s']:.1f} GB/s, "
              f"{result['kv_bytes_per_token'] / 1024:.0f} KiB per token of context): (matmul-only ideal + KV read) "
              f"/ wall {100 * result['roofline']:.1f}%")
    print(format_table(*efficiency_table(result)))


def profile_engine_args(args, engine_args: dict) -> dict:
    """The engine for the profile: room for the whole batch in the KV cache and the running set."""
    from pagedllm.bench.step_profile import profile_output_len, timed_decode_steps
    from pagedllm.config.runtime import default_step_tokens

    ea = dict(engine_args)
    ea["max_num_seqs"] = max(ea.get("max_num_seqs") or 1, args.batch_size)
    output_len = profile_output_len(args.batch_size, args.context_len, timed_decode_steps(args),
                                    ea.get("max_num_batched_tokens") or default_step_tokens("cpu", "generate"))
    seq_len = args.context_len + output_len
    if (ea.get("max_model_len") or 0) < seq_len:
        ea["max_model_len"] = seq_len
    block_size = ea.get("block_size") or 16
    needed = args.batch_size * (-(-seq_len // block_size) + 1)
    if (ea.get("num_kv_blocks") or 0) < needed:
        ea["num_kv_blocks"] = needed  # no preemption: every request stays in the batch
    return ea


def bench_profile(args, engine_args: dict) -> dict:
    from pagedllm.bench.engine_utils import build_llm
    from pagedllm.bench.step_profile import compare_switch, profile_table, run_step_profile

    ea = profile_engine_args(args, engine_args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run_step_profile(build_llm(**ea), args.batch_size, args.context_len, args.decode_steps,
                              args.torch_profiler, out, compare=compare_switch(args))
    result["engine_args"] = ea
    write_result(out, "profile", result)
    print(format_table(*profile_table(result)))
    for key, what in (("fused_ops_off", "the fused small CPU ops"), ("op_pool_off", "the ops' own worker threads")):
        if key in result:
            print(f"with {what} off (steps alternating with the ones above):")
            print(format_table(*profile_table(result[key])))
    return result


def bench_roofline(args, engine_args: dict) -> dict:
    from pagedllm.bench.engine_utils import build_llm
    from pagedllm.bench.plots import plot_lines
    from pagedllm.bench.roofline import roofline_table, run_roofline

    batch_sizes = int_list(args.batch_sizes)
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
