"""Recovering a preempted request: swapping its blocks back vs recomputing its KV.

For each block size, a request of `context_len` tokens is prefilled through the real engine;
then, on the real model runner, we time

    swap     copying its blocks out to the host pool and back (`kv_block_io.swap_blocks`, both ways:
             what a swap preemption costs), and
    recompute  a prefill forward of the same tokens (what a recompute preemption redoes).

On a GPU the swap crosses PCIe in block-sized pieces; on this CPU both pools are host memory,
so a swap is two memcpys. The published claim (recompute never above 20% of swap latency) is
about the GPU; here we report what this machine does. A second, end-to-end comparison runs the
same workload under memory pressure with each mode and reports throughput.
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedllm.bench.engine_utils import engine_prompts, request_params
from pagedllm.bench.workloads import WorkloadSpec, make_workload
from pagedllm.sampling_params import SamplingParams


def _median_time(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def recovery_cost(block_sizes=(8, 16, 32, 64), context_len: int = 512, repeats: int = 5, model: str | None = None) -> list[dict]:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.worker import kv_block_io
    from pagedllm.worker.model_runner import RunnerRequestState

    rows = []
    for block_size in block_sizes:
        llm = LLM(model=model, block_size=block_size, preemption_mode="swap", swap_space="256MiB",
                  max_model_len=context_len + 16, enable_prefix_caching=False)
        core = llm.engine.core
        runner = core.executor.runner  # a micro-benchmark of the runner's own block copies
        prompt = list(range(200, 200 + context_len))
        num_blocks = -(-context_len // block_size)
        device_blocks = list(range(num_blocks))
        host_blocks = list(range(num_blocks))
        assert num_blocks <= core.kv_info.num_host_blocks

        def swap_out_and_in():
            kv_block_io.swap_blocks(list(zip(device_blocks, host_blocks)), runner.kv_caches, runner.host_kv_caches)
            kv_block_io.swap_blocks(list(zip(host_blocks, device_blocks)), runner.host_kv_caches, runner.kv_caches)

        def recompute():
            state = RunnerRequestState(
                req_id="recompute", token_ids=list(prompt), num_prompt_tokens=context_len,
                params=SamplingParams(temperature=0, max_tokens=1), block_ids=list(device_blocks),
                num_computed_tokens=0, eos_token_ids=[], fork_children=[],
            )
            with torch.inference_mode():
                runner._execute([state], [context_len])

        recompute()  # warm-up (and fills the blocks)
        swap_out_and_in()
        swap_s = _median_time(swap_out_and_in, repeats)
        recompute_s = _median_time(recompute, repeats)
        rows.append({
            "block_size": block_size, "context_len": context_len, "num_blocks": num_blocks,
            "swap_ms": 1000 * swap_s, "recompute_ms": 1000 * recompute_s,
            "recompute_over_swap": recompute_s / swap_s,
            "swapped_mib": 2 * num_blocks * core.kv_info.bytes_per_block / 2**20,
        })
    return rows


def end_to_end(num_requests: int = 24, num_kv_blocks: int = 40, block_size: int = 16, model: str | None = None,
               input_len: int = 64, output_len: int = 96) -> list[dict]:
    from pagedllm.entrypoints.llm import LLM

    spec = WorkloadSpec(name="fixed", num_requests=num_requests, input_len=input_len, output_len=output_len)
    requests = make_workload(spec)
    rows, outputs = [], {}
    for mode in ("recompute", "swap"):
        llm = LLM(model=model, block_size=block_size, num_kv_blocks=num_kv_blocks, preemption_mode=mode,
                  swap_space="256MiB", enable_prefix_caching=False)
        start = time.perf_counter()
        result = llm.generate(engine_prompts(requests), [request_params(r) for r in requests], use_tqdm=False)
        elapsed = time.perf_counter() - start
        outputs[mode] = [o.outputs[0].token_ids for o in result]
        stats = llm.engine.stats()
        rows.append({"mode": mode, "elapsed_s": elapsed,
                     "output_tok_s": sum(map(len, outputs[mode])) / elapsed,
                     "num_preemptions": stats.num_preemptions, "num_swap_outs": stats.num_swap_outs})
    assert outputs["swap"] == outputs["recompute"], "swap and recompute gave different outputs"
    return rows


def preemption_tables(recovery: list[dict], e2e: list[dict]) -> str:
    lines = ["| block size | blocks | KV moved (MiB, out+in) | swap out+in (ms) | recompute (ms) | recompute / swap |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in recovery:
        lines.append(f"| {r['block_size']} | {r['num_blocks']} | {r['swapped_mib']:.1f} | {r['swap_ms']:.2f} "
                     f"| {r['recompute_ms']:.1f} | {r['recompute_over_swap']:.1f}x |")
    lines += ["", "| preemption mode | elapsed (s) | output tok/s | preemptions | swap-outs |", "|---|---:|---:|---:|---:|"]
    for r in e2e:
        lines.append(f"| {r['mode']} | {r['elapsed_s']:.1f} | {r['output_tok_s']:.1f} | {r['num_preemptions']} "
                     f"| {r['num_swap_outs']} |")
    return "\n".join(lines)
