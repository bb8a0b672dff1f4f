"""`pagedllm bench data-parallel`: a shared-prefix workload against real servers with 1 or N replicas.

    pagedllm bench data-parallel --groups 4 --per-group 8 --prefix-len 256 --suffix-len 32 --output-len 16

Several groups of requests, each group sharing a long prefix (a system prompt, a document), then a
short suffix of its own. One warm-up request per group goes first, one at a time (it puts the group's
prefix in some replica's cache); then all the others are sent together, groups interleaved, with a
bounded concurrency. Each configuration gets a fresh server:

    dp=N least-loaded     a group's requests scatter: each replica computes the prefix again
    dp=N prefix-affinity  a group's requests follow its prefix (bounded by load)
    dp=1                  the single engine, for the throughput comparison

Reported per configuration: wall time and generated tokens/s, the prefix-cache hit rate (prompt tokens
found cached / looked up, over the server's totals), routing decisions, and the CPU seconds spent by
the API-server process and by the engine-core processes (where the time goes: on a machine with few
cores the replicas compete for the same cores, so N replicas cannot beat one). Hit rate, routing and
CPU seconds are those of the first pass; `--repeats` adds passes in ABBA order for the throughput.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, write_result
from pagedllm.bench.subprocess_server import process_tree

# Routing decisions are counted per reason (affinity_hit, ...); the other metrics are summed over labels.
ROUTING_BY_REASON = {"pagedllm_routing_decisions_total": "reason"}


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "data-parallel", bench_data_parallel,
                        help="N replicas: least-loaded vs prefix-affinity routing on shared "
                             "prefixes; 1 vs N replicas throughput")
    p.add_argument("--replicas", type=int, default=2, help="N of the data-parallel runs")
    p.add_argument("--configs", default="least-loaded,prefix-affinity,single",
                   help="which runs: least-loaded, prefix-affinity (both with N replicas), single (1 replica)")
    p.add_argument("--groups", type=int, default=4, help="groups sharing a prefix")
    p.add_argument("--per-group", type=int, default=8, help="requests per group (the first is the warm-up)")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of a group's shared prefix")
    p.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own suffix")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight after the warm-ups")
    p.add_argument("--repeats", type=int, default=1, help="run the configs this many times, in ABBA order "
                                                           "(every other pass reversed): shared machines drift")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts' random tokens")


def make_prompts(groups: int, per_group: int, prefix_len: int, suffix_len: int, seed: int,
                 vocab: tuple[int, int] = (100, 10000)) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-ups: one per group, the rest: groups interleaved), as token-id prompts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*vocab) for _ in range(prefix_len)] for _ in range(groups)]

    def request(g: int) -> list[int]:
        return prefixes[g] + [rng.randrange(*vocab) for _ in range(suffix_len)]

    warmups = [request(g) for g in range(groups)]
    rest = [request(g) for _ in range(per_group - 1) for g in range(groups)]
    return warmups, rest


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cpu_by_role(server_pid: int) -> dict[str, float]:
    """CPU seconds of the API-server process and of its engine cores (with their children)."""
    result = {"api_server_cpu_s": 0.0, "engine_cores_cpu_s": 0.0}
    for pid in process_tree(server_pid):
        try:
            cpu = _cpu_seconds(pid)
        except OSError:
            continue
        result["api_server_cpu_s" if pid == server_pid else "engine_cores_cpu_s"] += cpu
    return result


def run_config(serve_args: list[str], warmups: list[list[int]], rest: list[list[int]], output_len: int,
               concurrency: int) -> dict:
    """One fresh server: the warm-ups one by one, then the rest concurrently; what it measured."""
    import httpx

    from pagedllm.bench.serving import ServerProcess

    log = tempfile.mkstemp(prefix="pagedllm-bench-dp-", suffix=".log")[1]
    server = ServerProcess(serve_args, log)
    try:
        def send(prompt: list[int]) -> int:
            r = httpx.post(f"{server.url}/v1/completions", timeout=600, json={
                "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        for prompt in warmups:
            send(prompt)
        before = server.metrics(ROUTING_BY_REASON)
        cpu_before = _cpu_by_role(server.proc.pid)
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            num_tokens = sum(pool.map(send, rest))
        wall_s = time.perf_counter() - start
        cpu_after = _cpu_by_role(server.proc.pid)
        after = server.metrics(ROUTING_BY_REASON)
    finally:
        server.stop()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("pagedllm_prefix_cache_queries_total")
    routed = {k.split(":", 1)[1]: v for k, v in after.items() if k.startswith("pagedllm_routing_decisions_total:")}
    return {
        "wall_s": wall_s, "num_requests": len(rest), "generated_tokens": num_tokens,
        "tokens_per_s": num_tokens / wall_s,
        "prefix_hit_rate": delta("pagedllm_prefix_cache_hits_total") / queries if queries else 0.0,
        "routing": routed,
        **{k: cpu_after[k] - cpu_before[k] for k in cpu_after},
    }


def bench_data_parallel(args, engine_args: dict) -> dict:
    from pagedllm.bench.cli_throughput import serve_args as _serve_args

    warmups, rest = make_prompts(args.groups, args.per_group, args.prefix_len, args.suffix_len, args.workload_seed)
    runs = {
        "least-loaded": {"data_parallel_size": args.replicas, "routing": "least-loaded"},
        "prefix-affinity": {"data_parallel_size": args.replicas, "routing": "prefix-affinity"},
        "single": {"data_parallel_size": 1, "routing": "least-loaded"},
    }
    names = [c for c in args.configs.split(",") if c]
    for name in names:
        if name not in runs:
            raise ValueError(f"unknown config {name!r}; choose from {', '.join(runs)}")
    results: dict[str, dict] = {}
    for k in range(args.repeats):
        for name in names if k % 2 == 0 else names[::-1]:
            serve = _serve_args({**engine_args, **runs[name]})
            measured = run_config(serve, warmups, rest, args.output_len, args.concurrency)
            if name not in results:
                results[name] = {**runs[name], **measured, "tokens_per_s_runs": []}
            results[name]["tokens_per_s_runs"].append(measured["tokens_per_s"])
    for r in results.values():
        r["tokens_per_s_median"] = statistics.median(r["tokens_per_s_runs"])
    result = {"engine_args": engine_args, "groups": args.groups, "per_group": args.per_group,
              "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "output_len": args.output_len,
              "concurrency": args.concurrency, "runs": results}
    write_result(Path(args.out), "data_parallel", result)
    print(data_parallel_table(result))
    return result


def data_parallel_table(result: dict) -> str:
    headers = ["run", "replicas", "tokens/s (median)", "tokens/s (each pass)", "prefix hit rate", "affinity hits",
               "API CPU s", "cores CPU s"]
    rows = [[name, r["data_parallel_size"], r["tokens_per_s_median"],
             " / ".join(f"{t:.2f}" for t in r["tokens_per_s_runs"]), r["prefix_hit_rate"],
             int(r["routing"].get("affinity_hit", 0)), r["api_server_cpu_s"], r["engine_cores_cpu_s"]]
            for name, r in result["runs"].items()]
    return format_table(headers, rows)
