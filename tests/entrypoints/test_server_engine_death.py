"""Killing the engine-core process of a server started with --keep-alive-on-engine-death: in-flight
and new requests get prompt 503s, /health says unhealthy, nothing hangs, and SIGTERM still stops the
server cleanly. (Without the flag the server exits 1: test_hardening_api.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer, pid_alive

pytestmark = pytest.mark.slow  # a real server in a subprocess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
    srv = RemoteServer(model_dir, ["--num-kv-blocks", "64", "--max-model-len", "1024", "--keep-alive-on-engine-death"],
                       tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def test_killed_engine_gives_503_and_sigterm_still_exits(server):
    url = server.url
    body = {"prompt": "Keep going", "max_tokens": 900, "ignore_eos": True}
    # in flight: one streaming and one non-streaming request
    stream = httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
    response = stream.__enter__()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    plain_result: dict = {}

    def plain_request():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        plain_result["status"], plain_result["body"] = r.status_code, r.json()

    plain = threading.Thread(target=plain_request)
    plain.start()
    time.sleep(0.5)

    core_pid = server.core_pid()
    killed_at = time.monotonic()
    os.kill(core_pid, signal.SIGKILL)

    rest = "\n".join(lines)  # the stream ends with an error event, then [DONE]
    stream.__exit__(None, None, None)
    assert '"engine_dead"' in rest and rest.rstrip().endswith("data: [DONE]")
    plain.join(10)
    assert not plain.is_alive()
    assert plain_result["status"] == 503 and plain_result["body"]["error"]["code"] == "engine_dead"
    assert time.monotonic() - killed_at < 5

    new = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert new.status_code == 503 and "engine" in new.json()["error"]["message"]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert chat.status_code == 503
    with pytest.raises(openai.InternalServerError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).completions.create(
            model="x", prompt="hi", max_tokens=2)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    assert server.metrics()["pagedllm_engine_healthy"] == 0

    assert server.stop() == 0
    assert not pid_alive(core_pid)
