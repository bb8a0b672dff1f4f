"""`pagedllm bench trace-efficiency` and `pagedllm bench profile`: how close a step gets to its matmuls.

    pagedllm bench trace-efficiency --workload sharegpt --num-requests 64     (wall vs matmul-only ideal)
    pagedllm bench profile --batch-size 64 --context-len 512                  (a decode step's time by part)
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.bench.common import format_table, write_result
from pagedllm.bench.workloads import add_workload_args, make_workload, spec_from_args


def add_fast_path_parsers(bsub, common) -> None:
    p = bsub.add_parser("trace-efficiency", help="engine wall time on a trace vs its matmul-only ideal")
    common(p)
    add_workload_args(p)
    p.set_defaults(num_requests=64)

    p = bsub.add_parser("profile", help="a decode step's time: matmuls, attention, everything else")
    common(p)
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

    ea = dict(engine_args)
    ea["max_num_seqs"] = max(ea.get("max_num_seqs") or 1, args.batch_size)
    output_len = profile_output_len(args.batch_size, args.context_len, timed_decode_steps(args),
                                    ea.get("max_num_batched_tokens") or 2048)
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
