"""`pagedllm bench data-parallel` in a smoke size: real servers with 2 replicas (least-loaded, then
prefix-affinity) and 1; affinity keeps every follow-up request of a group on the replica holding its
prefix, so its hit rate is at least least-loaded's."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.cli import main

pytestmark = pytest.mark.slow  # a real server in a subprocess


def test_data_parallel_bench_smoke(tiny_engine_args, tmp_path):
    groups, per_group = 3, 3
    argv = ["--log-level", "WARNING", "bench", "data-parallel", "--no-progress", "--out", str(tmp_path),
            "--model", tiny_engine_args["model"], "--num-kv-blocks", "64",
            "--max-model-len", str(tiny_engine_args["max_model_len"]), "--groups", str(groups),
            "--per-group", str(per_group), "--prefix-len", "64", "--suffix-len", "8", "--output-len", "4",
            "--concurrency", "4"]
    assert main(argv) == 0
    runs = json.loads((tmp_path / "data_parallel.json").read_text())["runs"]
    assert set(runs) == {"least-loaded", "prefix-affinity", "single"}
    num_rest = groups * (per_group - 1)
    for run in runs.values():
        assert run["num_requests"] == num_rest and run["generated_tokens"] == 4 * num_rest
        assert run["tokens_per_s"] > 0 and run["engine_cores_cpu_s"] > 0
    # every request, warm-ups included, counted once; all of least-loaded's are plain least-loaded
    assert runs["least-loaded"]["routing"] == {"least_loaded": groups * per_group}
    affinity = runs["prefix-affinity"]["routing"]
    assert affinity == {"affinity_miss": groups, "affinity_hit": num_rest}
    assert runs["prefix-affinity"]["prefix_hit_rate"] >= runs["least-loaded"]["prefix_hit_rate"]
    assert runs["prefix-affinity"]["prefix_hit_rate"] > 0.5
    assert runs["single"]["routing"] == {}  # one engine: no router
