"""The matmul-only ideal of a trace: step shapes, interpolation over the timed grid, the HF time cap."""

from __future__ import annotations

import pytest

from pagedllm.bench.trace_efficiency import StepShape, _grid, efficiency_table, ideal_seconds


def _step(tokens, sampled, seqs, single, end=0.0):
    return StepShape(num_tokens=tokens, num_sampled=sampled, num_seqs=seqs, num_single=single, end_s=end)


def test_step_kinds():
    assert _step(8, 8, 8, 8).kind == "decode"
    assert _step(512, 0, 1, 0).kind == "prefill"
    assert _step(512, 1, 2, 0).kind == "prefill"
    assert _step(575, 64, 64, 63).kind == "mixed"


def test_grid_reaches_the_largest_step_exactly():
    assert _grid(1) == [1]
    assert _grid(64) == [1, 2, 4, 8, 16, 32, 64]
    assert _grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_ideal_interpolates_linears_at_tokens_and_the_head_at_sampled_rows():
    grid = {"linear": {1: 1.0, 4: 4.0, 8: 6.0}, "head": {1: 0.5, 2: 1.0}}
    steps = [_step(2, 0, 1, 0), _step(4, 2, 2, 0), _step(6, 1, 6, 6), _step(8, 2, 8, 8)]
    assert ideal_seconds(steps, grid).tolist() == pytest.approx([2.0, 5.0, 5.5, 7.0])


def test_efficiency_table_rows():
    result = {"num_steps": 3, "engine_wall_s": 10.0, "ideal_s": 4.0, "efficiency": 0.4, "num_scheduled_tokens": 30,
              "by_kind": {"decode": {"steps": 2, "wall_s": 4.0, "ideal_s": 2.0, "mean_tokens": 5.0},
                          "prefill": {"steps": 1, "wall_s": 6.0, "ideal_s": 2.0, "mean_tokens": 20.0}}}
    headers, rows = efficiency_table(result)
    assert rows == [["all", 3, 10.0, 4.0, 0.4, 10.0], ["decode", 2, 4.0, 2.0, 0.5, 5.0],
                    ["prefill", 1, 6.0, 2.0, 1 / 3, 20.0]]


def test_hf_continuous_batching_under_a_time_cap_counts_streamed_tokens(tiny_model_dir):
    from pagedllm.bench.throughput import load_hf_model, run_hf_continuous
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    model = load_hf_model(tiny_model_dir)
    # 16 x 230 tokens: far more than HF produces on a CPU in the cap.
    requests = make_workload(WorkloadSpec("fixed", 16, max_model_len=256, input_len=16, output_len=230))
    result = run_hf_continuous(model, requests, kv_tokens=8192, max_batch_tokens=256, progress=False, time_cap_s=1.0)
    assert result["capped"] and result["elapsed_s"] == 1.0 and result["time_cap_s"] == 1.0
    assert 0 <= result["num_output_tokens"] < result["expected_output_tokens"] == 16 * 230
    assert result["num_finished_requests"] < 16
    assert result["output_tok_s"] == result["num_output_tokens"]


def test_efficiency_table_with_forward_timing_shows_the_share_outside_the_model():
    result = {"num_steps": 3, "engine_wall_s": 10.0, "ideal_s": 4.0, "efficiency": 0.4, "num_scheduled_tokens": 30,
              "forward_s": 8.0, "host_s": 2.0, "host_share": 0.2,
              "by_kind": {"decode": {"steps": 2, "wall_s": 4.0, "ideal_s": 2.0, "mean_tokens": 5.0, "forward_s": 3.0},
                          "prefill": {"steps": 1, "wall_s": 6.0, "ideal_s": 2.0, "mean_tokens": 20.0,
                                      "forward_s": 4.5}}}
    headers, rows = efficiency_table(result)
    assert headers[-1] == "outside the model / wall"
    assert [row[-1] for row in rows] == pytest.approx([0.2, 0.25, 0.25])


def test_step_recorder_times_each_steps_forward_and_lm_head(tiny_engine_args):
    """On a real engine: forward_s is the model's share of each step, and the hooks leave with the recorder."""
    import time

    from pagedllm.bench.engine_utils import build_llm
    from pagedllm.bench.trace_efficiency import StepRecorder, efficiency_result
    from pagedllm.sampling_params import SamplingParams

    llm = build_llm(**tiny_engine_args)
    core = llm.engine.core
    model = core.executor.runner.model
    calls = []
    original_forward = model.forward

    def slow_forward(*args, **kwargs):  # makes the model's share of a step large and known from below
        time.sleep(0.02)
        calls.append(1)
        return original_forward(*args, **kwargs)

    model.forward = slow_forward
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with StepRecorder(core, model) as recorder:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params, use_tqdm=False)
        wall = time.perf_counter() - start
    assert "compute_logits" not in vars(model) and not model._forward_hooks and not model._forward_pre_hooks
    assert len(recorder.steps) == len(calls) == 4
    ends = [start] + [s.end_s for s in recorder.steps]
    for step, begin, end in zip(recorder.steps, ends, ends[1:]):
        assert 0.02 <= step.forward_s <= end - begin
    result = efficiency_result(recorder.steps, start, wall, model, 0, repeats=1)
    assert result["forward_s"] == pytest.approx(sum(s.forward_s for s in recorder.steps))
    assert result["host_s"] == pytest.approx(wall - result["forward_s"])
    assert 0 < result["host_share"] < 1
    assert result["by_kind"]["decode"]["forward_s"] > 0


def test_step_recorder_counts_the_kv_tokens_each_step_reads(tiny_engine_args):
    """Prompts of 3 and 2 tokens, 4 outputs each: the prefill reads 3 + 2 tokens of context, then each
    decode one more per request; the KV-read term is those tokens times the cache's bytes per token."""
    import time

    from pagedllm.bench.engine_utils import build_llm
    from pagedllm.bench.trace_efficiency import StepRecorder, efficiency_result, kv_bytes_per_token
    from pagedllm.sampling_params import SamplingParams

    llm = build_llm(**tiny_engine_args)
    core = llm.engine.core
    runner = core.executor.runner
    config = runner.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = kv_bytes_per_token(runner.kv_caches)
    assert kv_bytes == config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # float32
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with StepRecorder(core) as recorder:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params, use_tqdm=False)
        wall = time.perf_counter() - start
    assert [s.kv_tokens for s in recorder.steps] == [5, 7, 9, 11]
    result = efficiency_result(recorder.steps, start, wall, runner.model, 0, repeats=1, kv_bytes=kv_bytes,
                               bandwidth_before=1e15)  # the larger of the two bandwidths is kept
    assert result["read_gb_s"] == pytest.approx(1e6)
    assert result["kv_read_s"] == pytest.approx(32 * kv_bytes / 1e15)
    assert result["roofline"] == pytest.approx((result["ideal_s"] + result["kv_read_s"]) / wall)
    assert sum(k["kv_read_s"] for k in result["by_kind"].values()) == pytest.approx(result["kv_read_s"])
    headers, rows = efficiency_table(result)
    assert headers[6:8] == ["KV-read floor s", "(ideal + KV read) / wall"]
    assert rows[0][6:8] == [result["kv_read_s"], result["roofline"]]


def test_each_grid_point_keeps_the_faster_of_the_two_timings():
    from pagedllm.bench.trace_efficiency import fastest_of

    after = {"linear": {1: 0.010, 2: 0.012, 5: 0.030}, "head": {1: 0.002, 3: 0.004}}
    before = {"linear": {1: 0.008, 2: 0.020, 4: 0.025}, "head": {1: 0.003}}
    merged = fastest_of(after, before)
    # 5 rows was not timed before (the before grid stops at powers of two): it keeps its own time.
    assert merged == {"linear": {1: 0.008, 2: 0.012, 5: 0.030}, "head": {1: 0.002, 3: 0.004}}
    assert fastest_of(after, None) is after


def test_the_union_of_grids_keeps_every_point_at_its_fastest():
    from pagedllm.bench.trace_efficiency import union_of

    a = {"linear": {1: 0.010, 2: 0.012, 64: 0.5}, "head": {1: 0.002}}
    b = {"linear": {1: 0.008, 2: 0.020, 4: 0.025}, "head": {1: 0.003, 8: 0.004}}
    assert union_of([a, b]) == {"linear": {1: 0.008, 2: 0.012, 4: 0.025, 64: 0.5}, "head": {1: 0.002, 8: 0.004}}


def test_profile_takes_one_compare_switch_at_a_time():
    from argparse import Namespace

    from pagedllm.bench.step_profile import compare_switch

    assert compare_switch(Namespace(compare_fused_ops=False, compare_op_pool=True)) == "op_pool"
    assert compare_switch(Namespace(compare_fused_ops=True, compare_op_pool=False)) == "fused_ops"
    assert compare_switch(Namespace()) is None
    with pytest.raises(ValueError, match="give one of them"):
        compare_switch(Namespace(compare_fused_ops=True, compare_op_pool=True))


def test_alternating_rounds_pair_each_engine_run_with_an_hf_run(tiny_engine_args):
    """rounds=3: three engine runs and three HF continuous-batching runs, paired in order; the systems
    table is the first pair, and the median is the middle ratio."""
    from pagedllm.bench.throughput import rounds_table, run_throughput
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    requests = make_workload(WorkloadSpec("fixed", 4, max_model_len=64, input_len=8, output_len=6))
    result = run_throughput(requests, tiny_engine_args, run_hf=False, progress=False, rounds=3)
    assert not result["errors"]
    rounds = result["rounds"]
    assert len(rounds) == 3
    engine, hf_cb = result["systems"]
    assert rounds[0]["engine_tok_s"] == engine["output_tok_s"] and rounds[0]["hf_cb_tok_s"] == hf_cb["output_tok_s"]
    for r in rounds:
        assert r["engine_tok_s"] == pytest.approx(4 * 6 / r["engine_s"])
        assert r["ratio"] == pytest.approx(r["engine_tok_s"] / r["hf_cb_tok_s"])
    assert result["median_round_ratio"] == sorted(r["ratio"] for r in rounds)[1]
    headers, rows = rounds_table(result)
    assert [row[0] for row in rows] == [1, 2, 3, "median"] and rows[-1][-1] == result["median_round_ratio"]


@pytest.mark.parametrize("kwargs, message", [(dict(rounds=0), "rounds must be >= 1"),
                                             (dict(rounds=2, run_hf_cb=False), "do not pass --no-hf-cb")])
def test_rounds_refuse_what_they_cannot_measure(tiny_engine_args, kwargs, message):
    from pagedllm.bench.throughput import run_throughput
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    requests = make_workload(WorkloadSpec("fixed", 1, max_model_len=64, input_len=4, output_len=2))
    with pytest.raises(ValueError, match=message):
        run_throughput(requests, tiny_engine_args, run_hf=False, progress=False, **kwargs)


def test_rounds_score_every_engine_run_against_one_grid(tiny_engine_args):
    """Engine-only rounds with trace efficiency: each run's ideal comes from the same (last, fastest)
    grid, so runs of one trace differ only in their wall time and recorded steps."""
    from pagedllm.bench.throughput import efficiency_rounds_table, run_throughput
    from pagedllm.bench.trace_efficiency import grid_of
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    # Prompts of 2+ blocks: the second run must not find them in the prefix cache (each run starts cold).
    requests = make_workload(WorkloadSpec("fixed", 3, max_model_len=64, input_len=40, output_len=4))
    result = run_throughput(requests, tiny_engine_args, run_hf=False, run_hf_cb=False, progress=False,
                            trace_efficiency=True, rounds=2)
    assert "rounds" not in result  # no HF runs to pair with
    first = result["systems"][0]["trace_efficiency"]
    rounds = result["efficiency_rounds"]
    assert len(rounds) == 2 and rounds[0]["engine_s"] == first["engine_wall_s"] == result["systems"][0]["elapsed_s"]
    assert rounds[0]["ideal_s"] == pytest.approx(rounds[1]["ideal_s"])  # same steps, same grid
    for r in rounds:
        assert r["efficiency"] == pytest.approx(r["ideal_s"] / r["engine_s"])
        assert r["roofline"] == pytest.approx((r["ideal_s"] + r["kv_read_s"]) / r["engine_s"])
    assert set(grid_of(first)) == {"linear", "head"}
    assert result["median_round_efficiency"] == pytest.approx((rounds[0]["efficiency"] + rounds[1]["efficiency"]) / 2)
    headers, rows = efficiency_rounds_table(result)
    assert [row[0] for row in rows] == [1, 2, "median"]


def test_the_ideal_of_a_moe_model_runs_only_the_routed_experts():
    """A tiny Qwen3-MoE (8 experts, top-2; layers 0 and 2 sparse): at M rows the linear(M) pass
    runs each sparse layer's router once and only the experts its rows are routed to, M * top_k
    rows in all; at one row that is top_k experts, not all eight."""
    import torch

    from pagedllm.bench.trace_efficiency import moe_groups, moe_layers, time_matmul_grid
    from pagedllm.model.moe import Qwen3MoeForCausalLM
    from tests.model.tiny_models import tiny_config

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_config("qwen3_moe"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.process_weights_after_loading()
    moes = moe_layers(model)
    assert len(moes) == 2 and moes[0].num_experts == 8 and moes[0].top_k == 2
    for m in (1, 3, 40):
        groups = moe_groups(moes[0], torch.randn(m, 64))
        assert sum(len(rows) for _, rows in groups) == 2 * m
        assert len(groups) == len({e for e, _ in groups}) <= min(8, 2 * m)

    router_calls, expert_rows = [], []
    for moe in moes:
        moe.gate.register_forward_hook(lambda module, args, out: router_calls.append(len(args[0])))
        moe.expert_mlp = lambda expert, rows, f=moe.expert_mlp: expert_rows.append(len(rows)) or f(expert, rows)
    grid = time_matmul_grid(model, max_tokens=1, max_sampled=1, repeats=1)
    assert list(grid["linear"]) == [1] and router_calls and set(router_calls) == {1}
    # Each layer's router runs once to route the grid point's rows (moe_groups), then once per timed
    # pass, and each pass runs top_k experts over one row each.
    passes = len(router_calls) - len(moes)
    assert passes >= 2 * len(moes) and expert_rows == [1] * (2 * passes)
