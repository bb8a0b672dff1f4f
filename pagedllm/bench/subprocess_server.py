"""A server in a subprocess: start a command, wait for its health URL, tail its log on failure, stop it.

One owner for what the benchmarks (pagedllm's own server, llama.cpp's `llama-server`) and the tests
(`pagedllm serve` on a tiny model) all do with a server process. It speaks only HTTP and /proc, so it
serves any server that answers ``GET <url>/health`` with 200 once ready.

    server = SubprocessServer(cmd, port, Path("serve.log"))   # returns once /health answers 200
    try:
        ...  # requests to server.url
    finally:
        server.stop()

Linux only where it reads /proc (the process tree, memory and CPU of the server's processes).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
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


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    return [pid] + [p for c in child_pids(pid) for p in process_tree(c)]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def read_metrics(url: str, split_by_label: dict[str, str] | None = None) -> dict[str, float]:
    """``GET url/metrics`` as metric name -> value, summed over labels.

    ``split_by_label`` maps a metric name to one of its labels to keep apart: those metrics come back
    as ``"name:label_value"`` keys instead (e.g. routing decisions by their reason)."""
    import httpx

    split_by_label = split_by_label or {}
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10, verify=False).text.splitlines():
        match = _METRIC_LINE.match(line)
        if not match:
            continue
        name = match.group(1)
        if name in split_by_label:
            label = re.search(rf'{split_by_label[name]}="([^"]*)"', match.group(2) or "")
            if label:
                name = f"{name}:{label.group(1)}"
        values[name] = values.get(name, 0.0) + float(match.group(3))
    return values


class SubprocessServer:
    """``cmd`` running in a subprocess, its output in ``log_path``; healthy once constructed.

    The constructor returns when ``GET {url}/health`` answers 200; if the process exits first or
    ``startup_timeout_s`` passes, it raises RuntimeError carrying the end of the log (and stops the
    process). ``stop()`` sends SIGTERM and kills what has not exited after ``timeout_s``."""

    def __init__(self, cmd: list[str], port: int, log_path: Path | str, *, name: str = "server",
                 scheme: str = "http", env: dict | None = None, cwd: Path | str | None = None,
                 startup_timeout_s: float = 300.0, poll_interval_s: float = 0.25,
                 own_process_group: bool = False) -> None:
        import httpx

        self.name = name
        self.port = port
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        # Its own process group lets stop() kill children the server left behind (llama-server's threads
        # are one process; pagedllm's engine cores exit with their parent on SIGTERM).
        self._own_process_group = own_process_group
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=own_process_group)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_interval_s)
        self.stop()
        raise RuntimeError(f"{name} was not healthy within {startup_timeout_s} s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def log_tail(self, num_chars: int = 5000) -> str:
        """The last ``num_chars`` characters of the server's output so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def metrics(self, split_by_label: dict[str, str] | None = None) -> dict[str, float]:
        """The server's /metrics (see `read_metrics`)."""
        return read_metrics(self.url, split_by_label)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the server and wait; kill it if it has not exited in ``timeout_s``. Returns its exit code.
        Calling it again does nothing more."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                if self._own_process_group:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> SubprocessServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
