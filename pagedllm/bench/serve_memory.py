"""`pagedllm bench serve-memory`: the resident memory of each `pagedllm serve` process, stage by stage.

    pagedllm bench serve-memory --model FILE.gguf --kv-cache-memory 272MiB --burst 16

One server (API process and engine core) on a free port; after it is ready, after one request and after
a burst of requests sent at once (their prompts prefilled together: a long step's activations are the
transient that sets the peak), each process's /proc/<pid>/status figures in MiB:

    peak     VmHWM, the most the process has held resident so far
    now      VmRSS
    anon     RssAnon: the heap, activations, the KV cache
    file     RssFile: mapped files (shared libraries' code, a memory-mapped model file)
    shmem    RssShmem: shared memory

Prompts are random token ids (no prefix-cache hits), `--prompt-len` each, `--output-len` greedy tokens
with EOS ignored. `--maps N` adds the N largest resident mappings of the largest process at each stage.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, write_result
from pagedllm.bench.subprocess_server import SubprocessServer, free_port, process_tree

MEMORY_FIELDS = {"VmHWM": "peak", "VmRSS": "now", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "serve-memory", bench_serve_memory,
                        help="resident memory of each `pagedllm serve` process: ready, one request, a burst")
    p.add_argument("--burst", type=int, default=16, help="requests sent at once in the last stage")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens per request")
    p.add_argument("--output-len", type=int, default=16, help="greedy tokens per request (EOS ignored)")
    p.add_argument("--maps", type=int, default=0, help="also list this many of the largest process's mappings")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts' random tokens")


def process_memory_mib(pid: int) -> dict[str, int] | None:
    """MEMORY_FIELDS of /proc/<pid>/status in MiB under their short names; None when the process is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return None
    return {short: int(fields[name].split()[0]) // 1024 for name, short in MEMORY_FIELDS.items() if name in fields}


def largest_mappings(pid: int, n: int) -> list[tuple[int, str]]:
    """The ``n`` largest resident mappings of a process as (MiB, name), summed by name ([anon] for unnamed ones)."""
    by_name: dict[str, int] = {}
    name = "[anon]"
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            name = head[5].strip() if len(head) == 6 else "[anon]"
        elif line.startswith("Rss:"):
            by_name[name] = by_name.get(name, 0) + int(line.split()[1])
    return sorted(((kib >> 10, name) for name, kib in by_name.items()), reverse=True)[:n]


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100].strip()
    except OSError:
        return ""


def _stage(name: str, server: SubprocessServer, maps: int) -> dict:
    processes = {}
    for pid in process_tree(server.proc.pid):
        memory = process_memory_mib(pid)
        if memory is not None:
            processes[pid] = {"role": "api server" if pid == server.proc.pid else _command_line(pid), **memory}
    stage = {"stage": name, "processes": processes}
    if maps and processes:
        largest = max(processes, key=lambda pid: processes[pid].get("now", 0))
        stage["largest_mappings_mib"] = largest_mappings(largest, maps)
    return stage


def _send(url: str, prompts: list[list[int]], output_len: int) -> None:
    import httpx

    async def all_at_once() -> None:
        async with httpx.AsyncClient(timeout=3600) as client:
            replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True})
                for prompt in prompts))
        for reply in replies:
            reply.raise_for_status()
            if reply.json()["usage"]["completion_tokens"] != output_len:
                raise RuntimeError(f"asked {output_len} tokens, got {reply.json()['usage']['completion_tokens']}")

    asyncio.run(all_at_once())


def bench_serve_memory(args, engine_args: dict) -> dict:
    from pagedllm.bench.cli_throughput import serve_args

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.workload_seed)

    def prompts(n: int) -> list[list[int]]:
        # Ids below 1000 exist in every vocabulary we serve; random, so no two prompts share a full block.
        return [[rng.randrange(100, 1000) for _ in range(args.prompt_len)] for _ in range(n)]

    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           *serve_args(engine_args)]
    server = SubprocessServer(cmd, port, out / "serve-memory.log", name="pagedllm serve", startup_timeout_s=900)
    try:
        stages = [_stage("ready", server, args.maps)]
        _send(server.url, prompts(1), args.output_len)
        stages.append(_stage("after 1 request", server, args.maps))
        _send(server.url, prompts(args.burst), args.output_len)
        stages.append(_stage(f"after {args.burst} at once", server, args.maps))
    finally:
        server.stop()
    result = {"engine_args": engine_args, "burst": args.burst, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "stages": stages}
    write_result(out, "serve_memory", result)
    print(serve_memory_table(result))
    return result


def serve_memory_table(result: dict) -> str:
    headers = ["stage", "process", *MEMORY_FIELDS.values()]
    rows = [[stage["stage"], f"{pid} {p['role']}"[:60], *(p.get(k, "") for k in MEMORY_FIELDS.values())]
            for stage in result["stages"] for pid, p in stage["processes"].items()]
    table = format_table(headers, rows)
    for stage in result["stages"]:
        for mib, name in stage.get("largest_mappings_mib", []):
            table += f"\n{stage['stage']}: {mib:6d} MiB  {name}"
    return table
