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
    modes = sorted(r["mode"] for r in result["runs"])
    assert modes == ["free", "json_schema"]
    for run in result["runs"]:
        assert run["output_tokens"] > 0 and run["tok_s"] > 0
        if run["mode"] == "json_schema":  # a random tiny model, yet whatever it finished is JSON
            assert run["num_valid_json"] == run["num_stopped"]
    assert result["free_tok_s"] > 0 and result["json_schema_tok_s"] > 0
    assert set(result["compile"]["schemas"]) == {"person", "tags", "rating"}
    assert all(v["compile_ms"] > 0 for v in result["compile"]["schemas"].values())
