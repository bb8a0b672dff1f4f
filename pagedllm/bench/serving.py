"""Online serving: Poisson arrivals against an OpenAI-compatible server, over real HTTP, streaming.

Each request is POST /v1/completions with the trace's prompt token ids, max_tokens = its
output length, ignore_eos (a vLLM-style extension our server honours), temperature 0,
stream=true and stream_options.include_usage (so the output token count is exact even if a
chunk carries several tokens). Per request we record:

    TTFT        time to the first streamed chunk carrying text
    ITL         gaps between successive content chunks
    TPOT        (latency - TTFT) / (output tokens - 1)
    latency     send to [DONE]; normalized latency = latency / output tokens (s/token, the
                vLLM paper's serving metric)

Per request rate: request and output-token throughput over the run, and p50/p90/p99 of each
metric. `run_sweep` starts a server (bench/baseline_server.py: `pagedllm serve` over a KV
allocation policy) once per policy (--kv-allocation-policy)
and sweeps the rates; `--url` targets an already running server instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.bench.subprocess_server import SubprocessServer, free_port
from pagedllm.bench.workloads import BenchRequest


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)


async def _send(client, url: str, model: str | None, request: BenchRequest) -> RequestRecord:
    payload = {"prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    record = RequestRecord()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:300]
                    return record
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if record.ttft is None:
                        record.ttft = now - start
                    else:
                        record.itls.append(now - last)
                    last = now
        record.latency = time.perf_counter() - start
        record.ok = record.ttft is not None and record.output_tokens > 0
        if not record.ok and record.error is None:
            record.error = "no text or no usage in the stream"
    except Exception as e:  # a failed request is reported, not fatal to the run
        record.error = f"{type(e).__name__}: {e}"
    return record


async def _run_rate(url: str, model: str | None, requests: list[BenchRequest], timeout_s: float) -> tuple[list[RequestRecord], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def fire(r: BenchRequest) -> RequestRecord:
            delay = start + r.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await _send(client, url, model, r)

        records = await asyncio.gather(*(fire(r) for r in requests))
        return list(records), time.perf_counter() - start


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(records: list[RequestRecord], duration_s: float, rate: float) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": rate, "num_requests": len(records), "num_ok": len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5], "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s, "output_tok_s": out_tokens / duration_s,
        "ttft_s": _percentiles([r.ttft for r in ok]),
        "tpot_s": _percentiles([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_s": _percentiles([x for r in ok for x in r.itls]),
        "latency_s": _percentiles([r.latency for r in ok]),
        "normalized_latency_s_per_token": _percentiles([r.latency / r.output_tokens for r in ok]),
    }


def with_poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int) -> list[BenchRequest]:
    """The same requests, arriving as a Poisson process at `rate` per second (inf = all at once)."""
    if math.isinf(rate):
        gaps = np.zeros(len(requests))
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(requests))
        gaps[0] = 0.0
    times = np.cumsum(gaps)
    return [BenchRequest(r.prompt_token_ids, r.output_len, float(t), r.n) for r, t in zip(requests, times)]


def run_client(url: str, requests: list[BenchRequest], rates: list[float], model: str | None = None,
               seed: int = 0, timeout_s: float = 3600, progress: bool = True) -> list[dict]:
    from tqdm.auto import tqdm

    rows = []
    for rate in tqdm(rates, desc=f"serving {url}", disable=not progress, unit="rate"):
        records, duration = asyncio.run(_run_rate(url, model, with_poisson_arrivals(requests, rate, seed), timeout_s))
        rows.append(summarize(records, duration, rate))
    return rows


# --- a server per policy ------------------------------------------------------------------


class ServerProcess(SubprocessServer):
    """`pagedllm serve` (bench/baseline_server.py) in a subprocess on a free loopback port; stop() ends it
    (and its engine core)."""

    def __init__(self, serve_args: list[str], log_path: str, startup_timeout_s: float = 300) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "pagedllm.bench.baseline_server", "--log-level", "WARNING",
               "--port", str(port), *serve_args]
        super().__init__(cmd, port, log_path, name="the server", startup_timeout_s=startup_timeout_s)


def run_sweep(requests: list[BenchRequest], rates: list[float], policies: list[str], serve_args: list[str],
              log_dir: str, url: str | None = None, seed: int = 0, progress: bool = True) -> dict:
    """One server per policy (or the given --url), the same requests at each rate."""
    results = {}
    if url is not None:
        results["external"] = run_client(url, requests, rates, seed=seed, progress=progress)
        return {"policies": results}
    for policy in policies:
        server = ServerProcess([*serve_args, "--kv-allocation-policy", policy],
                               os.path.join(log_dir, f"serve-{policy}.log"))
        try:
            results[policy] = run_client(server.url, requests, rates, seed=seed, progress=progress)
        finally:
            server.stop()
    return {"policies": results}


def serving_table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["policy", "rate req/s", "ok", "req/s", "output tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 s",
               "ITL p50 s", "ITL p99 s", "norm. latency p50 s/tok", "norm. latency mean s/tok"]
    rows = []
    for policy, sweep in result["policies"].items():
        for r in sweep:
            rows.append([policy, r["request_rate"], f"{r['num_ok']}/{r['num_requests']}", r["request_throughput"],
                         r["output_tok_s"], r["ttft_s"]["p50"], r["ttft_s"]["p99"], r["tpot_s"]["p50"],
                         r["itl_s"]["p50"], r["itl_s"]["p99"], r["normalized_latency_s_per_token"]["p50"],
                         r["normalized_latency_s_per_token"]["mean"]])
    return headers, rows
