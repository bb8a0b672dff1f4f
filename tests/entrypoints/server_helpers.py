"""Start a real `pagedllm serve` subprocess on a free loopback port, and read its /metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
    return children


def pid_alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


class RemoteServer:
    """`python -m pagedllm.entrypoints.cli serve [MODEL] ...` as a subprocess."""

    def __init__(self, model_dir: Path | None, extra_args: list[str], log_path: Path, env: dict | None = None,
                 startup_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.scheme = "https" if "--ssl-certfile" in extra_args else "http"
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        model = [str(model_dir)] if model_dir is not None else []  # None: the embedded default model
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "serve", *model,
               "--port", str(self.port), *extra_args]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy within {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def core_pid(self) -> int:
        """The engine-core process (the spawned child, not multiprocessing's resource tracker)."""
        for pid in child_pids(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return pid
        raise RuntimeError("no engine core child process found")

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name (with _total etc.) -> value, summed over labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$", line)
            if match:
                values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
        return values

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
        """SIGTERM the server; returns its exit code (killing it if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
