"""`pagedllm bench hardening` in a smoke size: a real server, a request at every limit beside an
ordinary one, then a short overload against a small waiting-queue bound."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.cli import main

pytestmark = pytest.mark.slow  # a real server in a subprocess


def test_hardening_bench_smoke(tiny_engine_args, tmp_path):
    argv = ["--log-level", "WARNING", "bench", "hardening", "--no-progress", "--out", str(tmp_path),
            "--model", tiny_engine_args["model"], "--num-kv-blocks", "128",
            "--max-model-len", str(tiny_engine_args["max_model_len"]), "--max-num-seqs", "32",
            "--max-num-waiting", "8", "--limit-n", "4", "--repeats", "1", "--burst", "4", "--duration-s", "2"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "hardening.json").read_text())
    neighbour = result["neighbour"]
    assert neighbour["alone_median_s"] > 0
    for name in ("beside_limits", "beside_plain"):
        assert neighbour[name]["heavy_request"]["status"] == 200, neighbour[name]  # at the limits, not past
    overload = result["overload"]
    assert result["capacity_req_s"] > 0 and overload["num_requests"] > 0
    assert overload["num_other"] == 0  # every answer is a 200 or a 429
    assert overload["num_ok"] + overload["num_429"] == overload["num_requests"]
