"""`pagedllm bench serve-memory` in a smoke size: a real server, its processes' memory at each stage."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.cli import main

pytestmark = pytest.mark.slow  # a real server in a subprocess


def test_serve_memory_bench_smoke(tiny_engine_args, tmp_path, capsys):
    argv = ["--log-level", "WARNING", "bench", "serve-memory", "--no-progress", "--out", str(tmp_path),
            "--model", tiny_engine_args["model"], "--num-kv-blocks", "32", "--max-model-len", "128",
            "--burst", "3", "--prompt-len", "40", "--output-len", "4", "--maps", "2"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "serve_memory.json").read_text())
    assert [s["stage"] for s in result["stages"]] == ["ready", "after 1 request", "after 3 at once"]
    for stage in result["stages"]:
        processes = stage["processes"].values()
        roles = [p["role"] for p in processes]
        assert roles.count("api server") == 1 and any("spawn_main" in r for r in roles)  # and its engine core
        for p in processes:
            assert 0 < p["now"] <= p["peak"] and p["anon"] > 0
        assert len(stage["largest_mappings_mib"]) == 2
    peaks = [max(p["peak"] for p in s["processes"].values()) for s in result["stages"]]
    assert peaks == sorted(peaks)  # a peak never falls
    assert "after 3 at once" in capsys.readouterr().out
