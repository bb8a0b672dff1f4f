"""`pagedllm bench moe` at a toy shape: its random checkpoint loads into the engine, each batch size
decodes together, the dense baseline really runs every expert (and only in its own steps), and the
ideal routes exactly the top-k experts per row."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.model.layers.moe import SparseMoE

TOY = ["--hidden", "64", "--layers", "2", "--experts", "8", "--moe-intermediate", "32", "--top-k", "2",
       "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "512"]


def test_moe_bench_toy_shape(tmp_path, monkeypatch):
    dense_calls = []
    dense = SparseMoE.forward_dense
    monkeypatch.setattr(SparseMoE, "forward_dense", lambda self, x: dense_calls.append(len(x)) or dense(self, x))
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "moe", "--no-progress", "--out", str(out), *TOY,
            "--batch-sizes", "1,5", "--repeats", "2", "--context-len", "8", "--model-dir", str(tmp_path / "ckpt")]
    assert main(argv) == 0
    result = json.loads((out / "moe.json").read_text())
    rows = {r["batch_size"]: r for r in result["rows"]}
    assert sorted(rows) == [1, 5]
    assert rows[1]["active_experts_per_layer"] == 2  # one row: its top-2 experts
    assert 2 <= rows[5]["active_experts_per_layer"] <= 8
    for r in rows.values():
        assert r["rounds"] == 2 and set(r["step_ratio"]) == {"dense/grouped", "ideal/grouped"}
        assert all(r[kind][mode] > 0 for kind in ("step_ms", "moe_ms") for mode in ("grouped", "dense", "ideal"))
    # Dense only in the dense steps: 2 steps x 2 layers per batch size, over the whole batch each time.
    assert dense_calls == [1] * 4 + [5] * 4
    # The checkpoint is reused when the shape is the same.
    stamp = (tmp_path / "ckpt" / "layer-000.safetensors").stat().st_mtime_ns
    assert main([*argv[:-4], "--batch-sizes", "1", "--repeats", "1", *argv[-2:]]) == 0
    assert (tmp_path / "ckpt" / "layer-000.safetensors").stat().st_mtime_ns == stamp


def test_times_are_the_fastest_round_and_ratios_the_median_of_per_round_ratios():
    from pagedllm.bench.moe import summarize

    rounds = [{"grouped": (0.010, 0.004), "dense": (0.040, 0.032), "ideal": (0.003, 0.005)},
              {"grouped": (0.020, 0.010), "dense": (0.060, 0.050), "ideal": (0.008, 0.004)},
              {"grouped": (0.012, 0.006), "dense": (0.030, 0.024), "ideal": (0.006, 0.006)}]
    s = summarize(rounds)
    assert s["rounds"] == 3
    assert s["step_ms"] == pytest.approx({"grouped": 10.0, "dense": 30.0, "ideal": 8.0})
    assert s["moe_ms"] == pytest.approx({"grouped": 4.0, "dense": 24.0, "ideal": 3.0})
    # per-round step ratios: dense 4, 3, 2.5 -> 3; ideal 0.8, 0.6, 1.0 -> 0.8
    assert s["step_ratio"] == pytest.approx({"dense/grouped": 3.0, "ideal/grouped": 0.8})
    # MoE: dense 8, 5, 4 -> 5; ideal 0.75, 0.8, 1.0 -> 0.8
    assert s["moe_ratio"] == pytest.approx({"dense/grouped": 5.0, "ideal/grouped": 0.8})
