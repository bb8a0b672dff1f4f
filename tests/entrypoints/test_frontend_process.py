"""The server's front-end process on the embedded model, as a user starts it: no torch in it (the model and torch
live in the engine core), the model card's sampling defaults in /v1/models, and every --served-model-name accepted."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow  # a real server in a subprocess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("frontend") / "server.log"
    srv = RemoteServer(None, ["--served-model-name", "first", "second", "--num-kv-blocks", "64"], log)
    yield srv
    srv.stop()


def _mapped_libraries(pid: int) -> set[str]:
    return {Path(line.split()[-1]).name for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if len(line.split()) >= 6}


def test_the_front_end_maps_no_torch_and_the_core_does(server):
    # after a request, so tokenization, chat templates and detokenization have all run in the front end
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "second", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    front_end = _mapped_libraries(server.proc.pid)
    core = _mapped_libraries(server.core_pid())
    assert any(name.startswith("libtorch_cpu") for name in core)  # the check can see torch where it is
    assert not [name for name in front_end if name.startswith(("libtorch", "libc10"))], sorted(front_end)


def test_models_lists_every_name_with_the_cards_sampling_defaults(server):
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["first", "second"]  # as vLLM lists its served names, first first
    assert [m["sampling_defaults"] for m in models] == [{"temperature": 0.2, "top_p": 0.9}] * 2
    for name, status in (("first", 200), ("second", 200), ("third", 404)):
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": name, "prompt": "Paris is", "max_tokens": 2})
        assert reply.status_code == status, reply.text
        if status == 200:
            assert reply.json()["model"] == "first"  # any served name is answered as the first, as vLLM does
    assert reply.json()["error"]["param"] == "model"
