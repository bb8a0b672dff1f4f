"""Every benchmark end to end in a smoke size, through `pagedllm bench`: JSON results, plots, sanity."""

from __future__ import annotations

import json
import math

import pytest

from pagedllm.bench.report import GENERATED_MARKER
from pagedllm.bench.workloads import TRACE_STATS, WorkloadSpec, make_workload, trace_stats
from pagedllm.entrypoints.cli import main

pytestmark = pytest.mark.slow  # bench all --smoke runs every benchmark


def test_workloads_are_seeded_and_shaped_like_the_published_traces():
    a = make_workload(WorkloadSpec("sharegpt", 2000, seed=7))
    assert a == make_workload(WorkloadSpec("sharegpt", 2000, seed=7))
    for name, (mean_in, mean_out, _) in TRACE_STATS.items():
        stats = trace_stats(make_workload(WorkloadSpec(name, 4000, max_model_len=2048)))
        assert stats["mean_input_len"] == pytest.approx(mean_in, rel=0.1)
        assert stats["mean_output_len"] == pytest.approx(mean_out, rel=0.1)
        assert stats["p50_output_len"] < stats["mean_output_len"]  # long-tailed
    for r in make_workload(WorkloadSpec("sharegpt", 500, max_model_len=256)):
        assert r.prompt_len + r.output_len <= 256 and r.output_len >= 1
    poisson = make_workload(WorkloadSpec("alpaca", 200, request_rate=4.0))
    times = [r.arrival_time for r in poisson]
    assert times == sorted(times) and times[0] == 0.0
    assert 200 / 4.0 * 0.7 < times[-1] < 200 / 4.0 * 1.3
    shared = make_workload(WorkloadSpec("shared_prefix", 3, prefix_len=32, input_len=8))
    assert all(r.prompt_token_ids[:32] == shared[0].prompt_token_ids[:32] and r.prompt_len == 40 for r in shared)


@pytest.fixture(scope="module")
def smoke_results(tiny_engine_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    argv = ["--log-level", "WARNING", "bench", "all", "--smoke", "--no-progress", "--out", str(out),
            "--model", tiny_engine_args["model"], "--num-kv-blocks", str(tiny_engine_args["num_kv_blocks"]),
            "--max-model-len", str(tiny_engine_args["max_model_len"]), "--max-num-seqs", "16",
            "--report", str(out / "results.md")]
    assert main(argv) == 0
    return out


def _load(out, name):
    result = json.loads((out / f"{name}.json").read_text())
    assert result["benchmark"] == name and result["machine"]["num_cpus"] >= 1 and result["machine"]["date"]
    return result


def test_throughput_smoke(smoke_results):
    result = _load(smoke_results, "throughput_alpaca")
    systems = {s["system"]: s for s in result["systems"]}
    assert set(systems) >= {"engine", "hf_static"}
    assert "hf_cb" in systems or "hf_cb" in result["errors"]
    for s in systems.values():
        assert s["output_tok_s"] > 0 and s["total_tok_s"] > s["output_tok_s"]
        assert s["num_output_tokens"] == result["hf_trace"]["total_output_tokens"] or s["system"] == "engine"
    assert systems["engine"]["engine_output_ratio"] == 1.0
    assert (smoke_results / "throughput_alpaca.png").stat().st_size > 0


def test_memory_smoke(smoke_results):
    result = _load(smoke_results, "memory_alpaca")
    for mode in ("simulated", "real"):
        rows = result[mode]["rows"]
        assert [r["policy"] for r in rows] == ["paged", "max", "pow2", "oracle"]
        for r in rows:
            assert sum(r["fractions"].values()) == pytest.approx(1.0)
            assert r["max_running"] >= 1 and r["steps"] > 0
    assert all(r["outputs_match_first_policy"] and r["output_tok_s"] > 0 for r in result["real"]["rows"])
    assert (smoke_results / "memory_alpaca_real.png").exists()
    assert "simulated" in _load(smoke_results, "memory_sharegpt")


def test_serving_smoke(smoke_results):
    result = _load(smoke_results, "serving_alpaca")
    (row,) = result["policies"]["paged"]
    assert row["num_ok"] == row["num_requests"] == 3, row["errors"]
    assert row["output_tok_s"] > 0 and math.isinf(row["request_rate"])
    assert 0 < row["ttft_s"]["p50"] <= row["latency_s"]["p50"]
    assert row["normalized_latency_s_per_token"]["p50"] > 0


def test_roofline_and_attention_smoke(smoke_results):
    roofline = _load(smoke_results, "roofline")
    assert roofline["bandwidth_gb_s"] > 0 and roofline["matmul_gflop_s"] > 0
    assert [r["batch_size"] for r in roofline["rows"]] == [1, 4]
    for r in roofline["rows"]:
        assert 0 < r["achieved_fraction_of_floor"] and r["step_ms"] > 0 and 0 < r["schedule_prepare_fraction"] < 1
    attention = _load(smoke_results, "attention")
    assert {r["phase"] for r in attention["rows"]} == {"decode", "prefill"}
    assert all(r["reference_ms"] > 0 and r["contiguous_ms"] > 0 and (r["op_ms"] is None or r["op_ms"] > 0)
               for r in attention["rows"])
    assert attention["mixed"]["ref_mixed_ms"] > 0


def test_the_report_has_every_section(smoke_results):
    text = (smoke_results / "results.md").read_text()
    assert text.splitlines()[0] == GENERATED_MARKER
    for heading in ("## Throughput", "## KV memory efficiency", "## Serving", "## Roofline", "## Attention overhead",
                    "## Prefix caching", "## Preemption recovery", "## Trace efficiency", "## A decode step",
                    "## Targets"):
        assert heading in text
    prefix = json.loads((smoke_results / "prefix_cache.json").read_text())
    assert prefix["shared_prefix"][0]["caching_on"]["prefill_tokens_skipped"] > 0
    assert prefix["zero_hit"]["prefill_tokens_skipped"] == 0
    preemption = json.loads((smoke_results / "preemption.json").read_text())
    assert [row["block_size"] for row in preemption["recovery"]] == [8, 16]
    assert all(row["swap_ms"] > 0 and row["recompute_ms"] > 0 for row in preemption["recovery"])
    assert "**Machine:**" in text and "**Date:**" in text and "| paged |" in text


def test_trace_efficiency_smoke(smoke_results):
    result = _load(smoke_results, "throughput_sharegpt")
    engine = result["systems"][0]
    eff = engine["trace_efficiency"]
    trace = result["trace"]
    assert eff["num_steps"] == engine["num_steps"] == sum(k["steps"] for k in eff["by_kind"].values())
    assert eff["num_sampled"] == trace["total_output_tokens"]  # one LM-head row per generated token
    # Every prompt token and every output token but the last is computed once, more after a preemption.
    computed = trace["total_input_tokens"] + trace["total_output_tokens"] - trace["num_requests"]
    assert eff["num_scheduled_tokens"] >= computed
    if eff["num_preemptions"] == 0:
        assert eff["num_scheduled_tokens"] == computed
    assert eff["num_preemptions"] == engine["num_preemptions"]
    assert 0 < eff["ideal_s"] < eff["engine_wall_s"] == pytest.approx(engine["elapsed_s"])
    assert eff["efficiency"] == pytest.approx(eff["ideal_s"] / eff["engine_wall_s"])
    # The grid reaches the largest step, so no step's ideal is extrapolated.
    assert max(int(m) for m in eff["matmul_grid_s"]["linear"]) == eff["max_step_tokens"]
    assert max(int(m) for m in eff["matmul_grid_s"]["head"]) == max(1, eff["max_step_sampled"])


def test_long_trace_and_capped_hf_smoke(smoke_results):
    result = _load(smoke_results, "throughput_sharegpt_long")
    systems = {s["system"]: s for s in result["systems"]}
    assert result["trace"]["num_requests"] == 6 and "hf_static" not in systems
    hf = systems.get("hf_cb")
    assert hf is not None or "hf_cb" in result["errors"]
    if hf is not None:
        assert hf["time_cap_s"] == 2.0
        if hf["capped"]:
            assert hf["elapsed_s"] == 2.0 and hf["num_output_tokens"] <= hf["expected_output_tokens"]
        else:
            assert hf["num_output_tokens"] == hf["expected_output_tokens"] and hf["num_finished_requests"] == 6


def test_decode_step_profile_smoke(smoke_results):
    result = _load(smoke_results, "profile")
    assert (result["batch_size"], result["context_len"], result["decode_steps_timed"]) == (4, 32, 2)
    shares = result["shares"]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["matmuls"] > 0 and shares["attention"] > 0 and shares["other"] > 0
    assert 0 < result["lm_head_share"] < shares["matmuls"]
    assert result["num_preemptions"] == 0 and result["step_ms"] > 0
    # The batch was prefilled once alone; resubmitted, each prompt hits every full block but the last token's.
    assert result["prefix_cache_hit_tokens"] == 4 * ((32 - 1) // 16) * 16
    assert "aten::" in (smoke_results / "profile_ops.txt").read_text()
