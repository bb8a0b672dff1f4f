"""The KV-sharing benchmark: `pagedllm bench sharing` end to end in a smoke size, and exact cases."""

from __future__ import annotations

import json

from pagedllm.bench.engine_utils import build_llm
from pagedllm.bench.sharing import measure_beam_search, measure_parallel_sampling
from pagedllm.bench.workloads import WorkloadSpec, make_workload
from pagedllm.entrypoints.cli import main


def test_sharing_smoke_through_the_cli(tiny_engine_args, tmp_path, capsys):
    argv = ["--log-level", "WARNING", "bench", "sharing", "--no-progress", "--out", str(tmp_path),
            "--model", tiny_engine_args["model"], "--num-kv-blocks", str(tiny_engine_args["num_kv_blocks"]),
            "--max-model-len", str(tiny_engine_args["max_model_len"]), "--max-num-seqs", "16",
            "--num-requests", "3", "--length-scale", "0.5", "--ns", "2,3", "--widths", "2,3"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "sharing_alpaca.json").read_text())
    assert result["workload"] == "alpaca" and result["trace"]["num_requests"] == 3
    rows = {(r["kind"], r["size"]): r for r in result["rows"]}
    assert set(rows) == {("parallel_sampling", 2), ("parallel_sampling", 3), ("beam_search", 2), ("beam_search", 3)}
    for r in rows.values():
        assert r["num_steps"] > 0 and 0 < r["mean_blocks_held"] < r["mean_blocks_without_sharing"]
        assert 0 < r["saved_percent"] < 100
    # more sequences share more; beams share their whole history, samples only the prompt
    assert rows[("beam_search", 3)]["saved_percent"] > rows[("beam_search", 2)]["saved_percent"]
    assert rows[("beam_search", 2)]["saved_percent"] > rows[("parallel_sampling", 2)]["saved_percent"]
    assert "| beam search | 3 |" in capsys.readouterr().out


def test_one_sequence_per_prompt_shares_nothing(tiny_engine_args):
    llm = build_llm(**tiny_engine_args)
    requests = make_workload(WorkloadSpec("alpaca", 3, max_model_len=128, length_scale=0.5))
    for stats in (measure_parallel_sampling(llm, requests, 1), measure_beam_search(llm, requests, 1)):
        assert stats.num_steps > 0
        assert stats.num_blocks_held == stats.num_blocks_unshared and stats.saved_fraction == 0.0
    assert llm.engine.core.check_kv_leaks() == []


def test_a_fixed_trace_saves_what_the_block_tables_say(tiny_engine_args):
    # A 32-token prompt (2 full blocks of 16) and 2 output tokens, n = 4: after the prefill step, the 4
    # samples share both prompt blocks and hold nothing else: 2 blocks held for 8 in the tables (after
    # the second step they are finished and hold nothing).
    llm = build_llm(**tiny_engine_args)
    requests = make_workload(WorkloadSpec("fixed", 1, max_model_len=128, input_len=32, output_len=2))
    stats = measure_parallel_sampling(llm, requests, 4)
    assert (stats.num_steps, stats.num_blocks_held, stats.num_blocks_unshared) == (1, 2, 8)
    assert stats.saved_fraction == 0.75
