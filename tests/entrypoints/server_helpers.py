"""Start a real `pagedllm serve` subprocess on a free loopback port, and read its /metrics."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedllm.bench.subprocess_server import SubprocessServer, child_pids, free_port, pid_alive

__all__ = ["REPO_ROOT", "RemoteServer", "child_pids", "concurrently", "free_port", "pid_alive"]

REPO_ROOT = Path(__file__).resolve().parents[2]


class RemoteServer(SubprocessServer):
    """`python -m pagedllm.entrypoints.cli serve MODEL ...` as a subprocess."""

    def __init__(self, model_dir: Path | None, extra_args: list[str], log_path: Path, env: dict | None = None,
                 startup_timeout_s: float = 180.0) -> None:
        port = free_port()
        model = [str(model_dir)] if model_dir is not None else []  # None: the embedded default model
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "serve", *model,
               "--port", str(port), *extra_args]
        super().__init__(cmd, port, log_path, scheme="https" if "--ssl-certfile" in extra_args else "http",
                         env=env, cwd=REPO_ROOT, startup_timeout_s=startup_timeout_s)

    def log(self) -> str:
        return self.log_tail()

    def core_pid(self) -> int:
        """The engine-core process (the spawned child, not multiprocessing's resource tracker)."""
        for pid in child_pids(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return pid
        raise RuntimeError("no engine core child process found")

    def wait_idle_without_leaks(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Wait until the engine is idle with every KV block free; assert its leak check found nothing."""
        deadline = time.monotonic() + timeout_s
        m: dict[str, float] = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if (m["pagedllm_num_requests_running"] == 0 and m["pagedllm_num_requests_waiting"] == 0
                    and m["pagedllm_kv_cache_usage_ratio"] == 0):
                time.sleep(0.3)  # the idle leak check follows the last step at once
                m = self.metrics()
                assert m["pagedllm_kv_cache_leaks"] == 0, self.log()
                return m
            time.sleep(0.1)
        raise AssertionError(f"engine not idle after {timeout_s} s: {m}")

    def stop(self, timeout_s: float = 20.0) -> int:
        return super().stop(timeout_s)


def concurrently(*calls):
    """The results of the calls (functions of no argument, each a request), in order, the requests sent at once:
    the engine decodes them in one batch, which on a small CPU costs little more than the longest alone."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]
