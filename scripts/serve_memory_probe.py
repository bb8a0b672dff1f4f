"""Peak resident memory of each `pagedllm serve` process: after start-up, after one request, after a burst of
requests sent at once (whose prompts are prefilled together: the step's activations are the transient):

    PYTHONPATH=$PWD .venv/bin/python scripts/serve_memory_probe.py --model <file.gguf> [--burst 16]
        [--kv-mib 272] [-- <more serve flags, e.g. --max-num-batched-tokens 512>]

Random 128-token prompts (no prefix-cache hits), 16 greedy tokens each, 2 threads. Prints VmHWM and VmRSS (MiB)
per process at each stage; the engine core is the largest.
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


def memory(pids: list[int]) -> dict[int, tuple[int, int]]:
    out = {}
    for pid in pids:
        try:
            fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        except OSError:
            continue
        out[pid] = (int(fields["VmHWM"].split()[0]) // 1024, int(fields["VmRSS"].split()[0]) // 1024)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=272)
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
        print(f"{stage}: " + "; ".join(f"pid {pid} peak {hwm} now {rss} MiB" for pid, (hwm, rss) in rows.items()),
              flush=True)

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
