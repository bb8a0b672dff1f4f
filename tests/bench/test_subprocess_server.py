"""The one subprocess-server owner: healthy once constructed, the log's tail when it dies, stop() ends it."""

from __future__ import annotations

import sys
import time

import httpx
import pytest

from pagedllm.bench.subprocess_server import SubprocessServer, free_port, pid_alive, process_tree, read_metrics


def static_server(root, log_path, **kwargs) -> SubprocessServer:
    """Python's file server over ``root``: GET /health answers 200 when ``root/health`` exists."""
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)]
    return SubprocessServer(cmd, port, log_path, name="file server", **kwargs)


def test_healthy_server_metrics_and_stop(tmp_path):
    (tmp_path / "health").write_text("ok")
    (tmp_path / "metrics").write_text(
        "# HELP x_total requests\n"
        'x_total{reason="a"} 2.0\n'
        'x_total{reason="b"} 3.0\n'
        "y 1.5e1\n")
    server = static_server(tmp_path, tmp_path / "server.log")
    try:
        assert server.proc.poll() is None
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert read_metrics(server.url) == {"x_total": 5.0, "y": 15.0}
        assert server.metrics({"x_total": "reason"}) == {"x_total:a": 2.0, "x_total:b": 3.0, "y": 15.0}
        assert process_tree(server.proc.pid)[0] == server.proc.pid
        assert "GET /health" in server.log_tail()
    finally:
        code = server.stop(timeout_s=10)
    assert code is not None and not pid_alive(server.proc.pid)
    assert server.stop() == code  # a second stop changes nothing


def test_a_server_that_exits_raises_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "print('cannot bind: port taken', flush=True); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)crasher exited with 3.*cannot bind: port taken"):
        SubprocessServer(cmd, free_port(), tmp_path / "crash.log", name="crasher", startup_timeout_s=30)


def test_a_server_never_healthy_is_stopped_after_the_timeout(tmp_path):
    # A file server without a /health file answers 404 forever.
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)file server was not healthy within 1.5 s.*404"):
        SubprocessServer(cmd, port, tmp_path / "slow.log", name="file server", startup_timeout_s=1.5)
    assert time.monotonic() - start < 20
    with pytest.raises(httpx.ConnectError):  # stopped: nothing listens on its port any more
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    code = ("import signal, functools, http.server, os\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"h = functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(tmp_path)!r})\n"
            f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), h).serve_forever()\n")
    server = SubprocessServer([sys.executable, "-c", code], port, tmp_path / "stubborn.log", own_process_group=True)
    assert server.stop(timeout_s=1) == -9
    assert not pid_alive(server.proc.pid)
