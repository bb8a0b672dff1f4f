"""Two data-parallel replicas behind one server, as local processes and as Ray actors: greedy outputs equal
the single engine's, requests spread over both, and killing one replica's core mid-run fails only the
requests it had started (its queued ones are re-sent to the other), /health says degraded, nothing hangs,
no block leaks; under Ray the replica comes back and serves again."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer, child_pids

pytestmark = pytest.mark.slow  # a real server in a subprocess

# One sequence at a time per replica: of four long requests, two run and two wait in the cores' queues,
# which makes "started" and "not started yet" exact when a replica dies.
SERVER_ARGS = ["--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "1", "-dp", "2"]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Hello, my name is",
           "The quick brown fox", "In 1492,"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def offline_texts(model_dir):
    llm = LLM(str(model_dir), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def by_replica(server: RemoteServer, name: str, **label_filter: str) -> dict[str, float]:
    """A labelled metric's values by replica (summed over its other labels)."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        match = re.match(rf"^{name}\{{([^}}]*)\}} (\S+)$", line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(labels.get(k) == v for k, v in label_filter.items()):
            values[labels["replica"]] = values.get(labels["replica"], 0.0) + float(match.group(2))
    return values


def check_outputs_and_spread(server: RemoteServer, offline_texts: list[str]) -> None:
    results: dict[int, str] = {}

    def send(i: int) -> None:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        results[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results.get(i) for i in range(len(PROMPTS))] == offline_texts
    routed = by_replica(server, "pagedllm_routing_decisions_total")
    assert set(routed) == {"0", "1"} and all(n >= 2 for n in routed.values()), routed
    assert sum(routed.values()) == len(PROMPTS)


class Stream(threading.Thread):
    """One long streaming completion; records whether it produced text and how it ended."""

    def __init__(self, server: RemoteServer, max_tokens: int) -> None:
        super().__init__()
        self.server, self.max_tokens = server, max_tokens
        self.first_data = threading.Event()
        self.outcome: str | None = None  # "ok", or the error code of the error event / response

    def run(self) -> None:
        body = {"prompt": "Keep going", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                self.outcome = json.loads(r.read())["error"]["code"]
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    self.outcome = event["error"]["code"]
                    return
                if event["choices"][0]["text"]:
                    self.first_data.set()
            self.outcome = "ok"


def wait_health(server: RemoteServer, status: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        r = httpx.get(f"{server.url}/health", timeout=10)
        body = r.json()
        if body["status"] == status:
            assert r.status_code == 200
            return body
        time.sleep(0.1)
    raise AssertionError(f"/health never said {status!r}: {body}\n{server.log()}")


def wait_replicas_idle(server: RemoteServer, replicas: set[str], timeout_s: float = 30.0) -> None:
    """Every listed replica idle with all KV blocks free, and its idle leak check clean."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        usage = by_replica(server, "pagedllm_replica_kv_cache_usage_ratio")
        running = by_replica(server, "pagedllm_replica_num_requests_running")
        if all(usage.get(r) == 0 and running.get(r) == 0 for r in replicas):
            time.sleep(0.5)  # the idle leak check follows the last step
            leaks = by_replica(server, "pagedllm_replica_kv_cache_leaks")
            assert all(leaks[r] == 0 for r in replicas), leaks
            return
        time.sleep(0.1)
    raise AssertionError(f"replicas {replicas} not idle: usage {usage}, running {running}")


def kill_one_replica(server: RemoteServer, core_pids: list[int]) -> None:
    # Long enough that no stream ends while the other replica is still starting its first: a replica whose
    # running request had finished would hold no queued one to re-send when it is killed.
    streams = [Stream(server, 400) for _ in range(4)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while True:  # one running per replica, one queued on each, none finished
        assert not any(s.outcome for s in streams), f"a stream ended before the kill: {[s.outcome for s in streams]}"
        if (sum(s.first_data.is_set() for s in streams) == 2
                and by_replica(server, "pagedllm_replica_num_requests_running") == {"0": 1.0, "1": 1.0}
                and by_replica(server, "pagedllm_replica_num_requests_waiting") == {"0": 1.0, "1": 1.0}):
            break
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.02)
    killed_at = time.monotonic()
    os.kill(core_pids[0], signal.SIGKILL)
    body = wait_health(server, "degraded", 10)
    assert time.monotonic() - killed_at < 5
    assert sorted(r["state"] for r in body["replicas"])[0] in ("down", "restarting")
    for s in streams:
        s.join(120)
        assert not s.is_alive()
    outcomes = sorted(s.outcome for s in streams)
    # the killed replica's running request fails; its queued one is re-sent and completes
    assert outcomes == ["engine_dead", "ok", "ok", "ok"], outcomes
    lost = by_replica(server, "pagedllm_replica_requests_lost_total", outcome="failed")
    retried = by_replica(server, "pagedllm_replica_requests_lost_total", outcome="retried")
    assert sum(lost.values()) == 1 and sum(retried.values()) == 1 and set(lost) == set(retried)
    assert server.proc.poll() is None  # the server lives on with one replica


# --- local processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_server(model_dir, tmp_path_factory):
    srv = RemoteServer(model_dir, SERVER_ARGS, tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def local_core_pids(server: RemoteServer) -> list[int]:
    return [pid for pid in child_pids(server.proc.pid)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_local_replicas_match_single_engine_and_share_the_load(local_server, offline_texts):
    body = httpx.get(f"{local_server.url}/health", timeout=10).json()
    assert body == {"status": "ok", "replicas": [{"replica": 0, "state": "up"}, {"replica": 1, "state": "up"}]}
    assert len(local_core_pids(local_server)) == 2
    check_outputs_and_spread(local_server, offline_texts)
    wait_replicas_idle(local_server, {"0", "1"})


def test_local_replica_killed_mid_run(local_server):
    pids = local_core_pids(local_server)
    kill_one_replica(local_server, pids)
    body = httpx.get(f"{local_server.url}/health", timeout=10).json()
    down = [r["replica"] for r in body["replicas"] if r["state"] == "down"]
    assert len(down) == 1  # a local replica stays down
    survivor = str(1 - down[0])
    wait_replicas_idle(local_server, {survivor})
    before = by_replica(local_server, "pagedllm_routing_decisions_total")
    r = httpx.post(f"{local_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    after = by_replica(local_server, "pagedllm_routing_decisions_total")
    assert after[survivor] == before[survivor] + 1 and after.get(str(down[0])) == before.get(str(down[0]))
    # the last replica dying takes the server down (exit 1), as a single engine does
    os.kill(local_core_pids(local_server)[0], signal.SIGKILL)
    assert local_server.proc.wait(30) == 1


# --- Ray -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_server(model_dir, tmp_path_factory):
    pytest.importorskip("ray")
    # the server starts a local Ray instance with dp x tp = 2 CPUs (no --ray-address)
    srv = RemoteServer(model_dir, [*SERVER_ARGS, "--distributed-executor-backend", "ray", "--ray-max-restarts", "2"],
                       tmp_path_factory.mktemp("logs") / "server.log", startup_timeout_s=300)
    yield srv
    srv.stop(60)


def ray_core_pids() -> list[int]:
    """Engine cores whose parent is one of our Ray replica actors."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"spawn_main" not in (proc / "cmdline").read_bytes():
                continue
            ppid = int(re.search(r"PPid:\s+(\d+)", (proc / "status").read_text()).group(1))
            if b"EngineReplicaActor" in Path(f"/proc/{ppid}/cmdline").read_bytes():
                pids.append(int(proc.name))
        except (OSError, AttributeError):
            pass
    return pids


def test_ray_replicas_match_single_engine_and_share_the_load(ray_server, offline_texts):
    assert len(ray_core_pids()) == 2
    wait_health(ray_server, "ok", 10)
    check_outputs_and_spread(ray_server, offline_texts)
    wait_replicas_idle(ray_server, {"0", "1"})


def test_ray_replica_killed_mid_run_comes_back(ray_server):
    old = ray_core_pids()
    kill_one_replica(ray_server, old)
    wait_health(ray_server, "ok", 180)  # Ray restarted the actor; its new core reported ready
    restarts = by_replica(ray_server, "pagedllm_replica_restarts_total")
    assert sum(restarts.values()) == 1
    back = next(iter(restarts))
    new = ray_core_pids()
    assert len(new) == 2 and old[0] not in new
    before = by_replica(ray_server, "pagedllm_routing_decisions_total")
    threads = [threading.Thread(target=lambda: httpx.post(f"{ray_server.url}/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 20, "ignore_eos": True}).raise_for_status()) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = by_replica(ray_server, "pagedllm_routing_decisions_total")
    assert after[back] - before[back] >= 1  # the restarted replica serves again
    wait_replicas_idle(ray_server, {"0", "1"})
