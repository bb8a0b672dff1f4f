"""The engine core's life around its front end: it exits within seconds of the front end's death,
busy or not, and leaves no socket directory; stale directories of dead engines are removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm.engine import ipc_dirs
from tests.engine.tiny_llama_dir import build_tiny_llama_dir

pytestmark = pytest.mark.slow  # engine cores in their own processes, killed and restarted


class SlowSteps:
    """A KV cache manager factory (picklable) whose every step after the first takes `delay_s`: a busy core,
    whatever the CPU. The first step (the prefill, which yields the first token) runs at full speed, so the
    front end sees the core stepping without first sitting out a whole `delay_s` (30 s in the hung case)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, num_blocks, num_host_blocks, cache_config, scheduler_config):
        from pagedllm.core.kv_cache_interface import paged_kv_cache_manager

        return _SlowKV(paged_kv_cache_manager(num_blocks, num_host_blocks, cache_config, scheduler_config),
                       self.delay_s)


class _SlowKV:
    def __init__(self, inner, delay_s: float) -> None:
        self._inner, self._delay_s = inner, delay_s
        self._num_calls = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def allocate_slots(self, *args, **kwargs):
        self._num_calls += 1
        if self._num_calls > 1:
            time.sleep(self._delay_s)
        return self._inner.allocate_slots(*args, **kwargs)


_FRONT_END = textwrap.dedent("""
    import asyncio, json, sys
    from pagedllm.config import EngineArgs
    from pagedllm.core.kv_cache_interface import plugged_kv_cache_manager
    from pagedllm.engine.core_client import MPCoreClient
    from pagedllm.engine.protocol import EngineCoreRequest, OutputsMsg
    from pagedllm.sampling_params import SamplingParams
    from tests.engine.test_core_lifecycle import SlowSteps

    async def main():
        args = EngineArgs(model=sys.argv[1], num_kv_blocks=64, block_size=16, max_model_len=1024)
        with plugged_kv_cache_manager(SlowSteps(float(sys.argv[2]))):  # the spawned core inherits it
            client = MPCoreClient(args, "WARNING")
        await client.wait_ready(120)
        params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
        client.add_request(EngineCoreRequest("busy", [1, 2, 3], params, [2], 900))
        while True:  # wait until the core is stepping the request
            msg = await client.get_output()
            if isinstance(msg, OutputsMsg) and any(o.new_token_ids for o in msg.outputs):
                break
        print(json.dumps({"core_pid": client.process.pid, "ipc_dir": client.ipc_dir}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def _running(pid: int) -> bool:
    return ipc_dirs._is_alive(pid)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-life")))


# The bounds say "by itself, long before its work would end" (900 tokens x 0.2 s; a 30 s step), with room for
# a loaded 2-core CI machine: the busy case took 4.5 s there once beside the other test worker (~0.5 s quiet).
@pytest.mark.parametrize("step_s, within_s", [
    (0.2, 10.0),   # a busy core: the loop stops after its current step (~0.5 s, then its exit)
    (30.0, 12.0),  # a step that never ends in time (a hung collective): the watchdog ends it (~2.3 s)
])
def test_a_busy_core_exits_within_seconds_of_its_front_end_being_killed(model_dir, step_s, within_s):
    parent = subprocess.Popen([sys.executable, "-c", _FRONT_END, model_dir, str(step_s)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep
                                                  + os.environ.get("PYTHONPATH", "")))
    core_pid = None
    try:
        line = parent.stdout.readline()
        assert line, "the front end did not start"
        info = json.loads(line)
        core_pid, ipc_dir = info["core_pid"], info["ipc_dir"]
        assert _running(core_pid) and os.path.isdir(ipc_dir)
        time.sleep(0.5)  # busy: the request has 900 tokens to go at step_s each
        assert _running(core_pid)

        parent.send_signal(signal.SIGKILL)
        parent.wait()
        killed_at = time.monotonic()
        while _running(core_pid) and time.monotonic() - killed_at < within_s + 5:
            time.sleep(0.05)
        took = time.monotonic() - killed_at
        assert not _running(core_pid), f"the engine core still runs {took:.1f} s after its front end died"
        assert took < within_s, f"the engine core took {took:.1f} s to exit"
        assert not os.path.exists(ipc_dir)
    finally:
        if parent.poll() is None:
            parent.kill()
        if core_pid is not None and _running(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_only_provably_stale_socket_directories_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def make(name: str, owners: str | None) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "input").write_text("")
        if owners is not None:
            (path / ipc_dirs.OWNERS_FILE).write_text(owners)
        return str(path)

    stale = make("pagedllm-ipc-stale", f"{dead.pid}")
    stale_both = make("pagedllm-ipc-both", f"{dead.pid} {dead.pid}")
    live = make("pagedllm-ipc-live", f"{dead.pid} {os.getpid()}")  # one owner still runs
    unmarked = make("pagedllm-ipc-nomark", None)
    garbled = make("pagedllm-ipc-garbled", "not a pid")
    other = make("someone-else-stale", f"{dead.pid}")
    os.symlink(stale, tmp_path / "pagedllm-ipc-link")

    removed = ipc_dirs.remove_stale_ipc_dirs(str(tmp_path))
    assert sorted(removed) == sorted([stale, stale_both])
    assert not os.path.exists(stale) and not os.path.exists(stale_both)
    assert all(os.path.isdir(p) for p in (live, unmarked, garbled, other))


def test_a_new_client_dir_names_its_owners(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = ipc_dirs.make_ipc_dir()
    assert os.path.basename(path).startswith(ipc_dirs.IPC_DIR_PREFIX)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o700)
    assert ipc_dirs._owners(path) == [os.getpid()]
    assert ipc_dirs.remove_stale_ipc_dirs(str(tmp_path)) == []  # we are alive
    assert ipc_dirs.ipc_dir_of(f"ipc://{path}/input") == path
    assert ipc_dirs.ipc_dir_of("ipc:///tmp/other/input") is None and ipc_dirs.ipc_dir_of("tcp://x:1") is None
