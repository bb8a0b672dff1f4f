"""`pagedllm bench tools` in a smoke size: a real server (a tiny random model with the default tokenizer), every
mode timed with the same prompt tokens, the forced modes answering with calls, a JSON result and a markdown table."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench.tools import MODES
from pagedllm.entrypoints.cli import main
from tests.engine.tiny_llama_dir import build_tiny_llama_dir

pytestmark = pytest.mark.slow  # a real server in a subprocess


def test_tools_bench_smoke(tmp_path):
    model = build_tiny_llama_dir(tmp_path / "tiny", max_position_embeddings=1024)
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "tools", "--no-progress", "--out", str(out), "--model", str(model),
            "--max-model-len", "512", "--num-kv-blocks", "96", "--max-num-seqs", "4", "--repeats", "2",
            "--max-tokens", "48"]
    assert main(argv) == 0
    result = json.loads((out / "tools.json").read_text())
    assert result["engine_args"]["enable_prefix_caching"] is False
    assert [r["mode"] for r in result["runs"]] == [*MODES, *MODES[1:], MODES[0]]  # alternating, rotated
    summary = result["summary"]
    assert set(summary) == set(MODES)
    assert len({tuple(s["prompt_tokens"]) for s in summary.values()}) == 1  # the same prompt in every mode
    for mode, s in summary.items():
        assert s["ttft_ms"] > 0 and s["cold_ttft_ms"] > 0 and s["completion_tokens"] >= 1, mode
    for mode in ("required", "named"):  # a random model, yet the grammar makes it call (or run out of tokens)
        runs = [r for r in result["runs"] if r["mode"] == mode]
        assert all(r["num_calls"] >= 1 and r["finish_reason"] in ("tool_calls", "length") for r in runs), runs
    assert all(r["num_calls"] == 0 for r in result["runs"] if r["mode"] in ("free", "json_schema"))
    table = (out / "tools.md").read_text()
    assert table.startswith("| mode |") and all(f"| {m} |" in table for m in MODES)
