"""`pagedllm bench moe` at a toy shape: its random checkpoint loads into the engine, each batch size
decodes together, the dense baseline really runs every expert (and only in its own steps), and the
ideal routes exactly the top-k experts per row."""

from __future__ import annotations

import json

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
        assert r["steps_timed"] == {"grouped": 2, "dense": 2, "ideal": 2}
        assert all(r[kind][mode] > 0 for kind in ("step_ms", "moe_ms") for mode in ("grouped", "dense", "ideal"))
    # Dense only in the dense steps: 2 steps x 2 layers per batch size, over the whole batch each time.
    assert dense_calls == [1] * 4 + [5] * 4
    # The checkpoint is reused when the shape is the same.
    stamp = (tmp_path / "ckpt" / "layer-000.safetensors").stat().st_mtime_ns
    assert main([*argv[:-4], "--batch-sizes", "1", "--repeats", "1", *argv[-2:]]) == 0
    assert (tmp_path / "ckpt" / "layer-000.safetensors").stat().st_mtime_ns == stamp
