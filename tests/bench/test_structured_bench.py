"""`pagedllm bench structured` in a smoke size: both modes run, tokens counted, compile times measured."""

from __future__ import annotations

import json

from pagedllm.entrypoints.cli import main


def test_structured_bench_smoke(tiny_engine_args, tmp_path):
    argv = ["--log-level", "WARNING", "bench", "structured", "--no-progress", "--out", str(tmp_path),
            "--model", tiny_engine_args["model"], "--num-kv-blocks", "64",
            "--max-model-len", str(tiny_engine_args["max_model_len"]), "--max-num-seqs", "8",
            "--batch-size", "4", "--max-tokens", "12", "--repeats", "1", "--compile-repeats", "1"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "structured.json").read_text())
    assert sorted(r["mode"] for r in result["runs"]) == ["free", "free_matched", "json_schema"]
    json_run, matched = result["runs"][:2]
    # the matched batch runs each request to its JSON's length (free text may stop earlier, never later)
    assert all(m <= j for m, j in zip(matched["lengths"], json_run["lengths"]))
    for run in result["runs"]:
        assert run["output_tokens"] > 0 and run["tok_s"] > 0
        if run["mode"] == "json_schema":  # a random tiny model, yet whatever it finished is JSON
            assert run["num_valid_json"] == run["num_stopped"]
    assert all(v > 0 for v in result["tok_s"].values())
    assert result["mask"]["steps"] == max(json_run["lengths"]) and result["mask"]["fill_ms_per_step"] > 0
    assert set(result["compile"]["schemas"]) == {"person", "tags", "rating"}
    assert all(v["compile_ms"] > 0 for v in result["compile"]["schemas"].values())
