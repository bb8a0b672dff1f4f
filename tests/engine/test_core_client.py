"""The engine core in its own process: ZMQ client round trips, rejection, abort, death, shutdown."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_interface import paged_kv_cache_manager, plugged_factory, plugged_kv_cache_manager
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_client import MPCoreClient
from pagedllm.engine.protocol import (
    AddRequestMsg,
    CoreMessage,
    EngineCoreRequest,
    FrontendMessage,
    OutputsMsg,
    RequestRejectedMsg,
    UtilityResultMsg,
)
from pagedllm.errors import EngineDeadError
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.interface import Executor, KVCacheInfo, ModelInfo
from tests.engine.tiny_llama_dir import build_tiny_llama_dir

NUM_BLOCKS = 32
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def engine_args(tmp_path_factory) -> EngineArgs:
    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
    return EngineArgs(model=str(model_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=1024)


def _request(req_id: str, prompt: list[int], max_tokens: int = 6, **params) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                             eos_token_ids=[2], max_tokens=max_tokens)


async def _next_of(client: MPCoreClient, kind, timeout_s: float = 60.0):
    """The next message of type `kind` (others, e.g. idle stats, are skipped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        msg = await asyncio.wait_for(client.get_output(), deadline - time.monotonic())
        if isinstance(msg, kind):
            return msg


async def _run_to_completion(client: MPCoreClient, req_ids: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r: [] for r in req_ids}
    pending = set(req_ids)
    while pending:
        msg = await _next_of(client, OutputsMsg)
        for out in msg.outputs:
            tokens[out.req_id].extend(out.new_token_ids)
            if out.finished:
                pending.discard(out.req_id)
    return tokens


async def _utility(client: MPCoreClient, method: str):
    """Call a utility method and wait for its result (other messages are skipped)."""
    call_id = client.request_utility(method)
    while True:
        msg = await _next_of(client, UtilityResultMsg)
        if msg.call_id == call_id:
            assert msg.error is None, msg.error
            return msg.result


async def _idle_stats(client: MPCoreClient):
    """Wait for the stats the core sends after its idle leak check."""
    while True:
        msg = await _next_of(client, OutputsMsg)
        if not msg.outputs and msg.stats.num_running == 0 and msg.stats.num_waiting == 0:
            return msg.stats


def test_messages_are_typed_msgpack():
    """Both unions round-trip through msgpack and reject anything that is not one of their messages."""
    encoder = msgspec.msgpack.Encoder()
    msg = AddRequestMsg(_request("a", [1, 2, 3], logit_bias={7: 1.5}, stop=["x"]))
    decoded = msgspec.msgpack.Decoder(FrontendMessage).decode(encoder.encode(msg))
    assert decoded == msg
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(CoreMessage).decode(encoder.encode(msg))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(FrontendMessage).decode(encoder.encode({"type": "add", "request": {"req_id": 1}}))


@pytest.mark.slow  # an engine core in its own process
def test_mp_client_matches_inproc_and_cleans_up(engine_args):
    """Greedy tokens over ZMQ equal the in-process core's; rejection, abort and shutdown behave."""
    inproc = EngineCore(engine_args)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [10, 20, 30]}
    for req_id, prompt in prompts.items():
        inproc.add_request(_request(req_id, prompt))
    expected: dict[str, list[int]] = {r: [] for r in prompts}
    while inproc.has_unfinished_requests():
        for out in inproc.step():
            expected[out.req_id].extend(out.new_token_ids)

    async def scenario():
        client = MPCoreClient(engine_args, log_level="WARNING")
        try:
            mode = stat.S_IMODE(os.stat(client.ipc_dir).st_mode)
            assert mode == 0o700
            ready = await client.wait_ready(120)
            assert ready.num_blocks == NUM_BLOCKS and ready.max_model_len == 1024 and ready.eos_token_ids == [2]

            for req_id, prompt in prompts.items():
                client.add_request(_request(req_id, prompt))
            assert await _run_to_completion(client, set(prompts)) == expected

            # needs more blocks than the whole cache: refused, nothing queued
            client.add_request(_request("huge", [5] * 600, max_tokens=400))
            rejected = await _next_of(client, RequestRejectedMsg)
            assert rejected.req_id == "huge" and "KV blocks" in rejected.message and rejected.invalid_request

            # a long request aborted mid-way frees its blocks; the idle check finds no leak
            client.add_request(_request("long", [3] * 40, max_tokens=300, ignore_eos=True))
            first = await _next_of(client, OutputsMsg)
            assert first.stats.num_running == 1 and first.stats.kv_cache_usage > 0
            client.abort_requests(["long"])
            stats = await _idle_stats(client)
            assert stats.kv_cache_usage == 0 and stats.num_kv_leaks == 0

            call_id = client.request_utility("check_kv_leaks")
            result = await _next_of(client, UtilityResultMsg)
            assert result.call_id == call_id and result.result == [] and result.error is None
            client.request_utility("no_such_method")
            assert "unknown utility" in (await _next_of(client, UtilityResultMsg)).error
        finally:
            client.shutdown()
        assert client.process.exitcode == 0
        assert not os.path.exists(client.ipc_dir)

    asyncio.run(scenario())


@pytest.mark.slow  # an engine core in its own process
def test_block_maps_while_watched_and_none_once_unwatched(engine_args):
    """watch_kv_map: a map at once, then with the stats while a request runs and when idle; unwatch_kv_map:
    none after it, though the lease (KV_MAP_LEASE_S) has not run out."""

    async def scenario():
        client = MPCoreClient(engine_args, log_level="WARNING")
        try:
            await client.wait_ready(120)
            await _idle_stats(client)
            client.request_utility("watch_kv_map")
            first_look = await _next_of(client, OutputsMsg)
            assert first_look.stats.kv_map is not None and not first_look.stats.kv_map.requests
            # A map a step builds waits KV_MAP_INTERVAL_S after the last one, and a fast machine can run the whole
            # request inside that: so the busy map asked for is a first look too (unwatch, then watch again
            # while the request runs), which the core sends at once.
            await _utility(client, "unwatch_kv_map")
            # 460 tokens: nearly the whole cache (32 blocks of 16), so the request outlasts the round trips below
            client.add_request(_request("long", [3] * 40, max_tokens=460, ignore_eos=True))
            first = await _next_of(client, OutputsMsg)
            assert first.stats.num_running == 1
            client.request_utility("watch_kv_map")
            while True:
                msg = await _next_of(client, OutputsMsg)
                if msg.stats.kv_map is not None:
                    assert [r.state for r in msg.stats.kv_map.requests] == ["running"]
                    break
            await _utility(client, "unwatch_kv_map")
            unwatched = []
            while True:  # to the end of the request, and the idle stats (a watched core sends a map there)
                msg = await _next_of(client, OutputsMsg)
                unwatched.append(msg)
                if not msg.outputs and msg.stats.num_running == 0 and msg.stats.num_waiting == 0:
                    break
            assert any(out.finished for msg in unwatched for out in msg.outputs)
            assert [msg for msg in unwatched if msg.stats.kv_map is not None] == []
        finally:
            client.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow  # an engine core in its own process
def test_killed_core_raises_engine_dead_promptly(engine_args):
    async def scenario():
        client = MPCoreClient(engine_args, log_level="WARNING")
        try:
            await client.wait_ready(120)
            client.add_request(_request("x", [1, 2, 3], max_tokens=500, ignore_eos=True))
            await _next_of(client, OutputsMsg)
            os.kill(client.process.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                while True:
                    await asyncio.wait_for(client.get_output(), 10)
            assert time.monotonic() - start < 3
            with pytest.raises(EngineDeadError):
                client.add_request(_request("y", [1]))
        finally:
            client.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow  # an engine core in its own process
def test_failed_model_load_is_reported(tmp_path):
    async def scenario():
        client = MPCoreClient(EngineArgs(model=str(tmp_path / "missing")), log_level="CRITICAL")
        try:
            with pytest.raises(EngineDeadError, match="does not exist"):
                await client.wait_ready(120)
        finally:
            client.shutdown()

    asyncio.run(scenario())


# --- the engine core's boundaries ---------------------------------------------------------------


def test_engine_core_imports_neither_torch_nor_the_model():
    code = ("import sys, pagedllm.engine.core, pagedllm.engine.core_proc; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('pagedllm.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_imports_nothing_above_it():
    import pagedllm.core

    above = ("pagedllm.worker", "pagedllm.model", "pagedllm.engine", "pagedllm.entrypoints", "pagedllm.bench",
             "torch")
    core_dir = Path(pagedllm.core.__file__).parent
    found = {f"{path.name}: {name}" for path in core_dir.glob("*.py") for name in _imported_modules(path)
             if name.startswith(above)}
    assert found == set()


class _EchoExecutor(Executor):
    """No model: every request that finishes its prompt samples token 7."""

    def __init__(self) -> None:
        self.model_info = ModelInfo(model_path="stub", hf_config=None,
                                    vocab_size=100, max_position_embeddings=64, eos_token_ids=(2,))
        self.sizing_args = None

    def initialize_kv_cache(self, cache_config, scheduler_config) -> KVCacheInfo:
        self.sizing_args = (cache_config, scheduler_config)
        return KVCacheInfo(num_blocks=6, num_host_blocks=0, block_size=cache_config.block_size,
                           bytes_per_block=1024, num_kv_heads=1)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids={rid: [7] for rid in sched.num_scheduled_tokens})


def test_engine_core_runs_on_what_the_executor_reports_and_the_injected_kv_manager():
    made = []

    def factory(num_blocks, num_host_blocks, cache_config, scheduler_config):
        made.append((num_blocks, num_host_blocks, cache_config.block_size, scheduler_config.max_model_len))
        return paged_kv_cache_manager(num_blocks, num_host_blocks, cache_config, scheduler_config)

    executor = _EchoExecutor()
    with plugged_kv_cache_manager(factory):
        core = EngineCore(EngineArgs(block_size=4), executor=executor)
    assert plugged_factory() is None  # plugged for that block only
    # max_model_len defaults to the model's context length, which only the executor knew
    assert made == [(6, 0, 4, 64)] and executor.sizing_args[1].max_model_len == 64
    assert core.scheduler.kv is core.kv_cache_manager and core.kv_cache_manager.num_blocks == 6
    core.add_request(_request("a", [5, 6, 8, 9, 10], max_tokens=3))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert tokens == [7, 7, 7]
    assert core.stats().num_preemptions == 0 and core.check_kv_leaks() == []
