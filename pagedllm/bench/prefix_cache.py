"""Automatic prefix caching: what a shared few-shot prefix saves, and what a 0% hit rate costs.

Both comparisons run caching on and off side by side in one process, on the same requests:

    shared prefix   every request = a common few-shot prefix (published: ~80 and ~341 tokens)
                    + its own short suffix; report throughput and prefill tokens skipped.
    0% hits         every prompt unique (random tokens), so caching only adds hashing and
                    bookkeeping; runs alternate on/off `repeats` times and report the median
                    (published: under 1% slower).
"""

from __future__ import annotations

import statistics
import time

from pagedllm.bench.engine_utils import engine_prompts, request_params
from pagedllm.bench.workloads import BenchRequest, WorkloadSpec, make_workload


def _timed_run(llm, requests: list[BenchRequest]) -> dict:
    before = llm.engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(engine_prompts(requests), [request_params(r) for r in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_in = sum(r.prompt_len for r in requests)
    assert llm.engine.core.check_kv_leaks() == []
    after = llm.engine.stats()
    return {
        "elapsed_s": elapsed,
        "output_tok_s": num_out / elapsed,
        "total_tok_s": (num_in + num_out) / elapsed,
        "prompt_tokens": num_in,
        "prefill_tokens_skipped": after.prefix_cache_hits - before.prefix_cache_hits,
        "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
        "token_ids": [c.token_ids for o in outputs for c in o.outputs],
    }


def _engines(engine_args: dict):
    from pagedllm.entrypoints.llm import LLM

    on = LLM(**{**engine_args, "enable_prefix_caching": True})
    off = LLM(**{**engine_args, "enable_prefix_caching": False})
    warm = [BenchRequest(list(range(100, 120)), 2)]
    for llm in (on, off):
        _timed_run(llm, warm)
    on.engine.reset_prefix_cache()
    return on, off


def run_shared_prefix(engine_args: dict, prefix_lens=(80, 341), num_requests: int = 32,
                      suffix_len: int = 24, output_len: int = 32, seed: int = 0) -> dict:
    on, off = _engines(engine_args)
    rows = []
    for prefix_len in prefix_lens:
        spec = WorkloadSpec(name="shared_prefix", num_requests=num_requests, prefix_len=prefix_len,
                            input_len=suffix_len, output_len=output_len, seed=seed,
                            max_model_len=on.engine.max_model_len)
        requests = make_workload(spec)
        result_off = _timed_run(off, requests)
        result_on = _timed_run(on, requests)
        assert result_on.pop("token_ids") == result_off.pop("token_ids"), "caching changed the outputs"
        on.engine.reset_prefix_cache()
        rows.append({
            "prefix_len": prefix_len, "num_requests": num_requests, "suffix_len": suffix_len,
            "output_len": output_len, "caching_off": result_off, "caching_on": result_on,
            "throughput_ratio": result_on["total_tok_s"] / result_off["total_tok_s"],
            "prefill_skipped_fraction": result_on["prefill_tokens_skipped"] / result_on["prompt_tokens"],
        })
    return {"shared_prefix": rows}


def run_zero_hit(engine_args: dict, num_requests: int = 24, input_len: int = 96, output_len: int = 24,
                 repeats: int = 5, seed: int = 0) -> dict:
    on, off = _engines(engine_args)
    times = {"on": [], "off": []}
    hits = 0
    # Repeat -1 is an untimed warm-up: both engines first touch their (lazily zeroed) KV pages there.
    for repeat in range(-1, repeats):
        # New random prompts every repeat: nothing can ever hit, not even the previous repeat.
        spec = WorkloadSpec(name="fixed", num_requests=num_requests, input_len=input_len, output_len=output_len,
                            seed=seed + 1000 * (repeat + 1), max_model_len=on.engine.max_model_len)
        requests = make_workload(spec)
        order = [("on", on), ("off", off)] if repeat % 2 == 0 else [("off", off), ("on", on)]
        for name, llm in order:
            result = _timed_run(llm, requests)
            if name == "on":
                hits += result["prefill_tokens_skipped"]
            if repeat >= 0:
                times[name].append(result["total_tok_s"])
    median_on, median_off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"zero_hit": {
        "num_requests": num_requests, "input_len": input_len, "output_len": output_len, "repeats": repeats,
        "total_tok_s_on": times["on"], "total_tok_s_off": times["off"],
        "median_on": median_on, "median_off": median_off,
        "slowdown_percent": 100.0 * (1 - median_on / median_off),
        "prefill_tokens_skipped": hits,
    }}


def prefix_tables(result: dict) -> str:
    lines = ["| shared prefix | caching off tok/s | caching on tok/s | ratio | prefill tokens skipped |",
             "|---:|---:|---:|---:|---:|"]
    for row in result.get("shared_prefix", []):
        lines.append(
            f"| {row['prefix_len']} | {row['caching_off']['total_tok_s']:.1f} | {row['caching_on']['total_tok_s']:.1f} "
            f"| {row['throughput_ratio']:.2f}x | {row['caching_on']['prefill_tokens_skipped']} of "
            f"{row['caching_on']['prompt_tokens']} ({100 * row['prefill_skipped_fraction']:.0f}%) |"
        )
    zero = result.get("zero_hit")
    if zero:
        lines += ["", "| 0% hit rate | median caching off tok/s | median caching on tok/s | slowdown |",
                  "|---|---:|---:|---:|",
                  f"| {zero['repeats']} alternating repeats | {zero['median_off']:.1f} | {zero['median_on']:.1f} "
                  f"| {zero['slowdown_percent']:+.2f}% |"]
    return "\n".join(lines)
