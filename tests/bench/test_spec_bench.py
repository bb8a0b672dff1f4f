"""`pagedllm bench speculative` in smoke mode: both workloads, two batch sizes, both proposers (the draft
a one-layer cut of the target), through the CLI."""

from __future__ import annotations

import json

from pagedllm.entrypoints.cli import main


def test_speculative_bench_smoke(tiny_model_dir, tmp_path, capsys):
    rc = main(["bench", "speculative", "--model", tiny_model_dir, "--max-model-len", "256", "--num-kv-blocks", "64",
               "--batch-sizes", "1,2", "--num-requests", "2", "--spec-output-len", "8", "--length-scale", "0.1",
               "--repeats", "1", "--num-speculative-tokens", "3", "--methods", "ngram,draft_model",
               "--draft-layers", "1", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "speculative.json").read_text())
    rows = result["rows"]
    assert {(r["workload"], r["batch_size"], r["proposer"]) for r in rows} == {
        (w, b, p) for w in ("copy", "alpaca") for b in (1, 2) for p in ("off", "ngram", "draft_model")}
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["tpot_ms"] > 0 and row["output_tokens"] > 0
        if row["proposer"] != "off":
            assert 0.0 <= row["acceptance_rate"] <= 1.0 and len(row["acceptance_per_position"]) == 3
    assert "accept by position" in capsys.readouterr().out
    assert result["speculative_configs"]["draft_model"]["num_speculative_tokens"] == 3
    assert result["draft_layers"] == 1
