"""KV blocks saved by sharing: parallel sampling (n samples) and beam search (width k).

After every engine step we count the distinct KV blocks the live sequences hold and the sum of
their block-table lengths, which is what they would hold if nothing were shared (each sample or
beam its own copy of the prompt and of the common history). Over a run,

    saved = 1 - sum over steps of blocks held / sum over steps of blocks without sharing

The vLLM paper (its Fig. 15, OPT-13B on the Alpaca trace) reports 6.1-9.8% saved for parallel
sampling with n = 2, 4, 6 and 37.6-55.2% for beam search with width 2, 4, 6. Requests run with
ignore_eos and max_tokens = their trace output length, so every sequence has the trace's length
(beam search then never ends early; parallel samples are seeded, temperature 1).
"""

from __future__ import annotations

import time

from pagedllm.bench.workloads import BenchRequest, trace_stats
from pagedllm.engine.beam_search import KVSharingStats, kv_block_usage
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

PUBLISHED = {"parallel_sampling": (6.1, 9.8), "beam_search": (37.6, 55.2)}
"""Percent of KV blocks saved, n or width 2..6, in the vLLM paper (Alpaca)."""


def measure_parallel_sampling(llm, requests: list[BenchRequest], n: int, seed: int = 0) -> KVSharingStats:
    """Run every request with n seeded samples; block usage of all live sequences after each step."""
    engine = llm.engine
    core = engine.core
    assert not engine.has_unfinished_requests(), "measure on an idle engine"
    stats = KVSharingStats()
    for i, request in enumerate(requests):
        params = SamplingParams(n=n, temperature=1.0, seed=seed + 1000 * i, max_tokens=request.output_len,
                                ignore_eos=True)
        engine.add_request(f"sharing-n{n}-{i}", {"prompt_token_ids": request.prompt_token_ids}, params)
    while engine.has_unfinished_requests():
        engine.step()
        num_held, num_unshared = kv_block_usage(core.kv_cache_manager, list(core.scheduler.requests))
        if num_unshared:
            stats.record(num_held, num_unshared)
    return stats


def measure_beam_search(llm, requests: list[BenchRequest], width: int) -> KVSharingStats:
    """Beam search of every request (max_tokens = its output length); the prompts' sharing summed."""
    params = [BeamSearchParams(width, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    outputs = llm.beam_search([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params)
    stats = KVSharingStats()
    for output in outputs:
        stats.merge(output.kv_sharing)
    return stats


def run_sharing(llm, requests: list[BenchRequest], ns=(2, 4, 6), widths=(2, 4, 6), progress: bool = False) -> dict:
    """Both measurements for each n and width on one engine; the rows of the result table."""
    rows = []
    for kind, sizes, measure in (("parallel_sampling", ns, measure_parallel_sampling),
                                 ("beam_search", widths, measure_beam_search)):
        for size in sizes:
            start = time.perf_counter()
            stats = measure(llm, requests, size)
            elapsed = time.perf_counter() - start
            assert llm.engine.core.check_kv_leaks() == [], llm.engine.core.check_kv_leaks()
            row = {
                "kind": kind, "size": size, "num_steps": stats.num_steps,
                "mean_blocks_held": stats.mean_blocks_held, "mean_blocks_without_sharing": stats.mean_blocks_unshared,
                "saved_percent": 100.0 * stats.saved_fraction, "published_percent_range": PUBLISHED[kind],
                "seconds": elapsed,
            }
            rows.append(row)
            if progress:
                print(f"{kind} {size}: {row['saved_percent']:.1f}% saved ({elapsed:.1f} s)", flush=True)
    return {"trace": trace_stats(requests), "block_size": llm.engine.core.kv_info.block_size,
            "rows": rows, "published_percent": PUBLISHED}


def sharing_table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["sharing", "n / width", "mean blocks held", "without sharing", "saved %", "published %", "seconds"]
    rows = []
    for r in result["rows"]:
        low, high = r["published_percent_range"]
        rows.append([r["kind"].replace("_", " "), r["size"], r["mean_blocks_held"], r["mean_blocks_without_sharing"],
                     r["saved_percent"], f"{low}-{high} (n/width 2-6)", r["seconds"]])
    return headers, rows
