"""Peak resident memory of each `pagedllm serve` process: after start-up, after one request, after a burst of
requests sent at once (whose prompts are prefilled together: the step's activations are the transient):

    PYTHONPATH=$PWD .venv/bin/python scripts/serve_memory_probe.py --model <file.gguf> [--burst 16]
        [--kv-mib 272] [-- <more serve flags, e.g. --max-num-batched-tokens 512>]

Random 128-token prompts (no prefix-cache hits), 16 greedy tokens each, 2 threads. Prints VmHWM and VmRSS (MiB)
per process at each stage, and the split of the resident pages now (anon: the heap, activations, the KV cache;
file: mapped files, shared libraries' code and the mmapped model file; shmem: shared memory); the engine core is
the largest. `--maps N` also prints the N largest resident mappings of the largest process at each stage.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx


def process_tree(root: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(root)], capture_output=True, text=True).stdout.split()
    return [root] + [pid for child in children for pid in process_tree(int(child))]


MEMORY_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def memory(pids: list[int]) -> dict[int, dict[str, int]]:
    """MEMORY_FIELDS of /proc/<pid>/status in MiB, per live process."""
    out = {}
    for pid in pids:
        try:
            fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        except OSError:
            continue
        out[pid] = {name: int(fields[name].split()[0]) // 1024 for name in MEMORY_FIELDS}
    return out


def largest_mappings(pid: int, n: int) -> list[tuple[int, str]]:
    """The n largest resident mappings (KiB, name) of a process, summed by file name ([anon] for the unnamed)."""
    by_name: dict[str, int] = {}
    name = "[anon]"
    try:
        lines = open(f"/proc/{pid}/smaps").read().splitlines()
    except OSError:
        return []
    for line in lines:
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            name = head[5].strip() if len(head) == 6 else "[anon]"
        elif line.startswith("Rss:"):
            by_name[name] = by_name.get(name, 0) + int(line.split()[1])
    return sorted(((kib, name) for name, kib in by_name.items()), reverse=True)[:n]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=272)
    parser.add_argument("--maps", type=int, default=0, help="print this many of the largest process's mappings")
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "serve", "--model", args.model,
           "--port", str(port), "--num-threads", "2", "--kv-cache-memory", str(args.kv_mib << 20), *args.serve_args]
    server = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)

    async def send(n: int) -> None:
        async with httpx.AsyncClient(timeout=3600) as client:
            replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
                "prompt": [rng.randrange(100, 40000) for _ in range(128)], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}) for _ in range(n)))
        for reply in replies:
            reply.raise_for_status()

    def report(stage: str) -> None:
        rows = memory(process_tree(server.pid))
        print(f"{stage}: " + "; ".join(
            f"pid {pid} peak {m['VmHWM']} now {m['VmRSS']} MiB (anon {m['RssAnon']} file {m['RssFile']} "
            f"shmem {m['RssShmem']})" for pid, m in rows.items()), flush=True)
        if args.maps and rows:
            largest = max(rows, key=lambda pid: rows[pid]["VmRSS"])
            for kib, name in largest_mappings(largest, args.maps):
                print(f"    {kib >> 10:6d} MiB  {name}", flush=True)

    try:
        start = time.time()
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode})")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        report(f"ready after {time.time() - start:.0f} s")
        asyncio.run(send(1))
        report("after 1 request")
        asyncio.run(send(args.burst))
        report(f"after {args.burst} at once")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()


if __name__ == "__main__":
    main()
