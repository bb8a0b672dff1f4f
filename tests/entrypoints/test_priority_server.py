"""Priority scheduling through a real `pagedllm serve`: the official `openai` client's extra_body={"priority": ...},
the 400 a first-come-first-served server answers, and queue time by priority in /metrics."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow  # a real server in a subprocess

MODEL_NAME = "tiny"
NUM_LOW = 4
LOW_PRIORITY, HIGH_PRIORITY = 10, 0
LONG_TOKENS = 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-prio"), initializer_range=0.3)


@pytest.fixture(scope="module")
def priority_server(model_dir, tmp_path_factory):
    # One sequence at a time: whoever the scheduler admits next is exactly who gets a first token next.
    srv = RemoteServer(model_dir, ["--served-model-name", MODEL_NAME, "--scheduling-policy", "priority",
                                   "--max-num-seqs", "1", "--num-kv-blocks", "128", "--max-model-len", "1024"],
                       tmp_path_factory.mktemp("logs") / "priority-server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fcfs_server(model_dir, tmp_path_factory):
    srv = RemoteServer(model_dir, ["--served-model-name", MODEL_NAME, "--num-kv-blocks", "64",
                                   "--max-model-len", "512"],
                       tmp_path_factory.mktemp("logs") / "fcfs-server.log")
    yield srv
    srv.stop()


def _num_waiting(server: RemoteServer) -> float:
    return server.metrics()["pagedllm_num_requests_waiting"]


def test_a_high_priority_request_behind_a_queue_of_low_ones_gets_its_first_token_first(priority_server):
    client = openai.AsyncOpenAI(base_url=f"{priority_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    first_token_at: dict[str, float] = {}
    finished_at: dict[str, float] = {}

    async def run(name: str, priority: int, max_tokens: int) -> str:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=f"Request {name} says", max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"priority": priority, "ignore_eos": True})
        text = []
        async for chunk in stream:
            first_token_at.setdefault(name, time.monotonic())
            text.append(chunk.choices[0].text if chunk.choices else "")
        finished_at[name] = time.monotonic()
        return "".join(text)

    async def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(condition):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def scenario() -> dict[str, str]:
        tasks = {"low0": asyncio.create_task(run("low0", LOW_PRIORITY, LONG_TOKENS))}
        await wait_for(lambda: "low0" in first_token_at, "the first low-priority request to run")
        # One at a time, so that the low ones arrive in a known order (ties go by arrival).
        for i in range(1, NUM_LOW):
            tasks[f"low{i}"] = asyncio.create_task(run(f"low{i}", LOW_PRIORITY, 16))
            await wait_for(lambda: _num_waiting(priority_server) == i, f"low{i} to be queued")
        tasks["high"] = asyncio.create_task(run("high", HIGH_PRIORITY, 16))
        await wait_for(lambda: _num_waiting(priority_server) == NUM_LOW, "high to be queued")
        queued_behind_at = time.monotonic()
        texts = {name: await task for name, task in tasks.items()}
        # The order below is only meaningful if `high` joined the queue while low0 still held the one slot.
        assert finished_at["low0"] > queued_behind_at
        return texts

    texts = asyncio.run(scenario())
    assert all(texts.values())
    order = sorted(first_token_at, key=first_token_at.get)
    assert order == ["low0", "high", "low1", "low2", "low3"], order


def test_queue_time_is_exported_by_priority(priority_server):
    """Read after the test above (same server): one high-priority observation, the low ones separately."""
    client = openai.OpenAI(base_url=f"{priority_server.url}/v1", api_key="none", max_retries=0, timeout=60)
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                   extra_body={"priority": -3})
    priority_server.wait_idle_without_leaks()
    text = httpx.get(f"{priority_server.url}/metrics", timeout=10).text
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^pagedllm_request_queue_time_seconds_count\{[^}]*priority="([^"]+)"[^}]*\} (\S+)$', text, re.M)}
    assert counts["-3"] == 1
    assert counts[str(HIGH_PRIORITY)] == 1 and counts[str(LOW_PRIORITY)] == NUM_LOW
    sums = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^pagedllm_request_queue_time_seconds_sum\{[^}]*priority="([^"]+)"[^}]*\} (\S+)$', text, re.M)}
    assert sums[str(HIGH_PRIORITY)] > 0  # it waited for the long low-priority request


def test_priority_on_a_fcfs_server_is_a_400_naming_it(fcfs_server):
    client = openai.OpenAI(base_url=f"{fcfs_server.url}/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"priority": 1})
    assert "priority must be 0" in str(info.value) and "--scheduling-policy priority" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="priority must be 0"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_body={"priority": -1})
    # 0 is the default priority: accepted
    ok = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"priority": 0})
    assert ok.choices[0].finish_reason == "length"
    bad_type = httpx.post(f"{fcfs_server.url}/v1/completions", timeout=30,
                          json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "priority": "high"})
    assert bad_type.status_code == 400 and "priority" in bad_type.text
