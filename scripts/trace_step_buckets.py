"""Where a trace's decode steps spend their time, by batch size: each step's wall time beside its
matmul-only ideal and its KV-read floor (pagedllm/bench/trace_efficiency.py), summed per bucket of
sequences in the step (1, 2-3, 4-7, ...), so the time neither explains shows per regime:

    .venv/bin/python scripts/trace_step_buckets.py [sharegpt|alpaca] [--num-requests 64]

The engine runs the trace once (default engine arguments, greedy, every request its trace output
length), then the model's linears are timed on the matmul grid and the read bandwidth measured, in
the same process. Per bucket: steps, wall ms per step, matmul-only ideal ms, KV-read floor ms, the
residual (wall - ideal - floor) and the model's forward (forward + LM head) ms, and the mean tokens
of context read.
"""

import argparse
import collections
import math
import time

import numpy as np

from pagedllm import LLM
from pagedllm.bench.attention import read_bandwidth
from pagedllm.bench.engine_utils import engine_prompts, request_params
from pagedllm.bench.trace_efficiency import StepRecorder, ideal_seconds, kv_bytes_per_token, time_matmul_grid
from pagedllm.bench.workloads import WorkloadSpec, make_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", nargs="?", default="sharegpt", choices=["sharegpt", "alpaca"])
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()
    requests = make_workload(WorkloadSpec(name=args.workload, num_requests=args.num_requests))
    llm = LLM()
    llm.generate([{"prompt_token_ids": requests[0].prompt_token_ids[:8]}], request_params(requests[0]),
                 use_tqdm=False)  # warm-up
    runner = llm.engine.core.executor.runner
    with StepRecorder(llm.engine.core, runner.model) as recorder:
        start = time.perf_counter()
        llm.generate(engine_prompts(requests), [request_params(r) for r in requests], use_tqdm=False)
        elapsed = time.perf_counter() - start
    steps = recorder.steps
    grid = time_matmul_grid(runner.model, max(s.num_tokens for s in steps), max(s.num_sampled for s in steps))
    bandwidth = read_bandwidth()
    kv_bytes = kv_bytes_per_token(runner.kv_caches)
    ideal = ideal_seconds(steps, grid)
    buckets = collections.defaultdict(lambda: np.zeros(6))
    previous = start
    for step, step_ideal in zip(steps, ideal):
        wall, previous = step.end_s - previous, step.end_s
        key = step.kind if step.kind != "decode" else f"decode {2 ** int(math.log2(step.num_seqs)):3d}+"
        buckets[key] += [1, wall, step_ideal, step.kv_tokens * kv_bytes / bandwidth, step.forward_s, step.kv_tokens]
    print(f"{args.workload}: {elapsed:.1f} s, {len(steps)} steps, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| steps | count | wall ms/step | matmul-only ideal ms | KV-read floor ms | residual ms | forward ms "
          "| context tokens read |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(buckets):
        count, wall, step_ideal, kv, forward, kv_tokens = buckets[key]
        print(f"| {key} | {int(count)} | {wall / count * 1e3:.1f} | {step_ideal / count * 1e3:.1f} | "
              f"{kv / count * 1e3:.1f} | {(wall - step_ideal - kv) / count * 1e3:.1f} | {forward / count * 1e3:.1f} "
              f"| {kv_tokens / count:.0f} |")


if __name__ == "__main__":
    main()
