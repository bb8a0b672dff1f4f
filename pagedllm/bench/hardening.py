"""Serving hardening, measured over HTTP against `pagedllm serve` (a benchmark, not a timed test).

    pagedllm bench hardening [engine flags] [--url URL] [--max-num-waiting 16] [--overload 2]

1. An ordinary request's latency alone, then beside a request at every limit (stop-token ids,
   logit-bias entries, stop strings, logprobs, prompt logprobs, sequences per request): the ratio is
   how much one hostile-but-valid request slows its neighbours (the issue asks for <= 1.5x).
2. Capacity (ordinary requests per second when a burst keeps the server saturated), then Poisson
   arrivals at `overload` x capacity with the waiting queue bounded: goodput, the share of 429s
   and the latency of the admitted requests.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

ORDINARY = {"prompt": "The capital of France is Paris. The capital of Italy is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}


@dataclass(frozen=True)
class Limits:
    """The "request at every limit": the defaults sit at the engine's RequestLimits defaults."""

    num_stop_token_ids: int = 256
    num_logit_bias: int = 300
    num_stop: int = 16
    logprobs: int = 20
    num_prompts: int = 4
    n: int = 64
    max_tokens: int = 64


def limit_request(limits: Limits, vocab_size: int = 49152, with_lists: bool = True) -> dict:
    """The request at every limit; without `with_lists`, the same sequences with none of the per-request
    lists (what the batch itself costs a neighbour, apart from the lists)."""
    rng = random.Random(0)
    plain = {
        "prompt": [f"Story {i}: once upon a time" for i in range(limits.num_prompts)],
        "n": limits.n, "max_tokens": limits.max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": 1,
    }
    if not with_lists:
        return plain
    return {
        **plain,
        "stop_token_ids": rng.sample(range(1000, vocab_size), limits.num_stop_token_ids),
        "logit_bias": {str(t): 0.5 for t in rng.sample(range(1000, vocab_size), limits.num_logit_bias)},
        "stop": [f"zq{i}xv" for i in range(limits.num_stop)],
        "logprobs": limits.logprobs, "echo": True,  # echo + logprobs asks for prompt logprobs too
    }


async def _ordinary_latency(client, url: str, repeats: int) -> list[float]:
    latencies = []
    for _ in range(repeats):
        started = time.perf_counter()
        r = await client.post(f"{url}/v1/completions", json=ORDINARY)
        r.raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


async def neighbour_slowdown(url: str, limits: Limits, repeats: int, headers: dict) -> dict:
    """Median latency of an ordinary request alone, and while a request at every limit runs beside it."""
    import httpx

    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        await _ordinary_latency(client, url, 2)  # warm up
        alone = await _ordinary_latency(client, url, repeats)
        result = {"limits": limits.__dict__, "alone_s": alone, "alone_median_s": statistics.median(alone)}
        for name, with_lists in (("beside_limits", True), ("beside_plain", False)):
            status: dict = {}

            async def heavy() -> None:
                r = await client.post(f"{url}/v1/completions", json=limit_request(limits, with_lists=with_lists))
                status["status"] = r.status_code
                status["message"] = r.json().get("error", {}).get("message") if r.status_code != 200 else None

            task = asyncio.ensure_future(heavy())
            await asyncio.sleep(1.0)  # admitted and decoding
            beside = await _ordinary_latency(client, url, repeats) if not task.done() else []
            await task
            result[name] = {"latencies_s": beside, "heavy_request": status}
            if beside:
                result[name]["median_s"] = statistics.median(beside)
                result[name]["slowdown"] = result[name]["median_s"] / result["alone_median_s"]
    return result


async def _capacity(url: str, burst: int, headers: dict) -> float:
    """Ordinary requests completed per second while `burst` of them are in flight at once."""
    import httpx

    async with httpx.AsyncClient(timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=burst + 8)) as client:
        started = time.perf_counter()
        responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=ORDINARY)
                                           for _ in range(burst)))
        elapsed = time.perf_counter() - started
    num_ok = sum(r.status_code == 200 for r in responses)
    return num_ok / elapsed


async def overload(url: str, rate: float, duration_s: float, headers: dict, seed: int = 0) -> dict:
    """Poisson arrivals at `rate` for `duration_s`: goodput, share of 429s, admitted latency."""
    import httpx

    rng = random.Random(seed)
    records: list[tuple[int, float]] = []

    async def one(client) -> None:
        started = time.perf_counter()
        try:
            r = await client.post(f"{url}/v1/completions", json=ORDINARY)
            status = r.status_code
        except httpx.HTTPError:
            status = -1
        records.append((status, time.perf_counter() - started))

    async with httpx.AsyncClient(timeout=600, headers=headers, limits=httpx.Limits(max_connections=4096)) as client:
        tasks = []
        started = time.perf_counter()
        next_at = 0.0
        while next_at < duration_s:
            await asyncio.sleep(max(0.0, started + next_at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(client)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    ok = sorted(latency for status, latency in records if status == 200)
    num_429 = sum(status == 429 for status, _ in records)
    return {
        "offered_rate": rate, "num_requests": len(records), "num_ok": len(ok), "num_429": num_429,
        "num_other": len(records) - len(ok) - num_429, "share_429": num_429 / max(1, len(records)),
        "goodput_req_s": len(ok) / elapsed,
        "ok_latency_p50_s": ok[len(ok) // 2] if ok else None,
        "ok_latency_p99_s": ok[min(len(ok) - 1, int(len(ok) * 0.99))] if ok else None,
    }


def run_hardening(url: str, limits: Limits, repeats: int, overload_factor: float, duration_s: float,
                  burst: int, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = {"neighbour": asyncio.run(neighbour_slowdown(url, limits, repeats, headers))}
    capacity = asyncio.run(_capacity(url, burst, headers))
    result["capacity_req_s"] = capacity
    result["overload"] = asyncio.run(overload(url, overload_factor * capacity, duration_s, headers))
    result["overload"]["factor"] = overload_factor
    return result


def hardening_tables(result: dict) -> str:
    from pagedllm.bench.common import format_table

    n = result["neighbour"]
    rows = [["alone", n["alone_median_s"], ""]]
    for key, label in (("beside_limits", "beside a request at every limit"),
                       ("beside_plain", "beside the same sequences without the lists")):
        b = n[key]
        rows.append([label, b.get("median_s"),
                     f"{b['slowdown']:.2f}x" if "slowdown" in b else f"not measured: {b['heavy_request']}"])
    part1 = format_table(["ordinary request", "median latency (s)", "slowdown"], rows, floatfmt="{:.3f}")
    o = result["overload"]
    part2 = format_table(
        ["capacity (req/s)", "offered (req/s)", "goodput (req/s)", "429 share", "other errors", "ok p50 (s)",
         "ok p99 (s)"],
        [[result["capacity_req_s"], o["offered_rate"], o["goodput_req_s"], f"{o['share_429']:.0%}", o["num_other"],
          o["ok_latency_p50_s"], o["ok_latency_p99_s"]]], floatfmt="{:.3f}")
    return f"{part1}\n\n{part2}"
