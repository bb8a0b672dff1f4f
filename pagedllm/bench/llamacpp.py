"""pagedllm's server beside llama.cpp's `llama-server`: the processes, the client, the measurements.

Both servers run as real processes on the same GGUF file with the same thread count and are driven
by the same client code over HTTP: POST /v1/completions with prompt token ids, temperature 0,
max_tokens = the output length and ignore_eos (both servers honour it), not streamed; the output
token count is the response's usage.completion_tokens (a request that returns fewer tokens than
asked is an error, not a faster request). Output tok/s counts the whole request (prefill
included), as the user waits for it:

    single user   one request at a time; per round each server gets the round's prompt once, the
                  order alternating between rounds (A B, B A, ...) so a slow spell of the shared
                  machine lands on both; reported: median and best over the rounds
    concurrent    N requests sent at once (the same N prompts to both servers); output tokens of
                  all of them / wall time from the first send to the last response
    memory        peak resident set (VmHWM in /proc/<pid>/status) of each server's processes:
                  pagedllm's API server and its engine core(s), llama-server's single process;
                  VmRSS at the end too. llama-server maps the GGUF, so its resident set counts the
                  file's pages it has touched; pagedllm reads the file and repacks it.

Every round uses fresh random prompts, so neither server's prompt/prefix cache sees a repeat.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from pagedllm import envs
from pagedllm.bench.subprocess_server import SubprocessServer, free_port, process_tree

DEFAULT_VERSION = "0.3.36"


def llama_server_binary(version: str = DEFAULT_VERSION) -> Path:
    """Where scripts/build_llama_server.sh caches the binary ($PAGEDLLM_CACHE or ~/.cache/pagedllm)."""
    root = envs.PAGEDLLM_CACHE
    return root / "llama-server" / version / "llama-server"


def missing_binary_message(path: Path) -> str:
    return (f"llama-server is not built: {path} is missing. Build it once (10-25 minutes on 2 cores; "
            f"cached afterwards) with: scripts/build_llama_server.sh, or pass --llama-server PATH")


def memory_kib(pid: int) -> dict[str, int]:
    """VmHWM (peak resident) and VmRSS of ``pid`` in KiB (empty when it is gone)."""
    found = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                found[key] = int(value.split()[0])
    except OSError:
        pass
    return found


def _command_line(pid: int, limit: int = 120) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:limit].strip()
    except OSError:
        return ""


class Server(SubprocessServer):
    """A server process on a free loopback port, healthy (GET /health answers 200) once constructed, whose
    processes' peak memory it samples."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, startup_timeout_s: float = 900,
                 env: dict | None = None) -> None:
        self._peaks: dict[int, int] = {}
        self._names: dict[int, str] = {}
        super().__init__(cmd, port, log_path, name=name, env=env, startup_timeout_s=startup_timeout_s,
                         poll_interval_s=0.5, own_process_group=True)
        self.sample_memory()

    def sample_memory(self) -> None:
        """Record each process's VmHWM now (an engine core that exits would take its peak with it)."""
        for pid in process_tree(self.proc.pid):
            hwm = memory_kib(pid).get("VmHWM")
            if hwm is not None:
                self._peaks[pid] = max(hwm, self._peaks.get(pid, 0))
                self._names.setdefault(pid, _command_line(pid))

    def memory(self) -> dict:
        """Peak and current resident memory in MiB: the main process, its children, and their sum."""
        self.sample_memory()
        pids = process_tree(self.proc.pid)
        rss = {pid: memory_kib(pid).get("VmRSS", 0) for pid in pids}
        main = self.proc.pid
        return {
            "peak_mib_main": self._peaks.get(main, 0) / 1024,
            "peak_mib_children": sum(v for p, v in self._peaks.items() if p != main) / 1024,
            "peak_mib_total": sum(self._peaks.values()) / 1024,
            "peak_mib_largest": max(self._peaks.values(), default=0) / 1024,
            "rss_mib_total": sum(rss.values()) / 1024,
            "num_processes": len(self._peaks),
            "peak_mib_by_process": {f"{pid} {self._names.get(pid, '')}": v / 1024 for pid, v in self._peaks.items()},
        }


def start_pagedllm(model: str, threads: int, kv_cache_bytes: int, log_dir: Path, extra: list[str]) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", model, "--port", str(port),
           "--num-threads", str(threads), "--kv-cache-memory", str(kv_cache_bytes), *extra]
    return Server("pagedllm", cmd, port, log_dir / "pagedllm-serve.log")


def start_llama_server(binary: Path, model: str, threads: int, ctx_tokens: int, slots: int, log_dir: Path,
                       extra: list[str]) -> Server:
    """llama-server with ``slots`` parallel sequences over one unified KV cache of ``ctx_tokens`` (f16),
    its prompt cache off (-cram 0) and no web UI."""
    port = free_port()
    cmd = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx_tokens), "-np", str(slots), "--kv-unified", "-cram", "0",
           "--no-webui", *extra]
    return Server("llama.cpp", cmd, port, log_dir / "llama-server.log")


# --- the client ---------------------------------------------------------------------------------


async def _complete(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": False})
    latency = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
    tokens = response.json()["usage"]["completion_tokens"]
    if tokens != max_tokens:
        raise RuntimeError(f"{url}: {tokens} output tokens where {max_tokens} were asked (ignore_eos ignored?)")
    return {"latency_s": latency, "output_tokens": tokens}


async def _batch(url: str, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(_complete(client, url, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - start
    tokens = sum(d["output_tokens"] for d in done)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "latency_s_mean": statistics.fmean(d["latency_s"] for d in done)}


def run_batch(url: str, prompts: list[list[int]], max_tokens: int, timeout_s: float = 3600) -> dict:
    """Send ``prompts`` at once to ``url``; their output tok/s over the wall time of the batch."""
    return asyncio.run(_batch(url, prompts, max_tokens, timeout_s))


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids drawn away from both ends of the vocabulary (where the special tokens sit)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    low, high = min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size * 3 // 4)
    return rng.integers(low, high, size=(count, length)).tolist()


def alternate(servers: list[Server], rounds: int, make_prompts, max_tokens: int, sample=None) -> dict:
    """Each round: every server gets the round's prompts (one batch), the order reversed on odd rounds.
    Returns {server name: [per-round batch result]}."""
    results: dict[str, list[dict]] = {s.name: [] for s in servers}
    for r in range(rounds):
        prompts = make_prompts(r)
        for server in (servers if r % 2 == 0 else servers[::-1]):
            results[server.name].append(run_batch(server.url, prompts, max_tokens))
            server.sample_memory()
            if sample:
                sample(server.name, r, results[server.name][-1])
    return results
