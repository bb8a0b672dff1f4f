"""KV memory accounting: fractions, the simulation's faithfulness, and identical outputs per policy."""

from __future__ import annotations

import pytest

from pagedllm.bench.engine_utils import build_llm
from pagedllm.bench.memory import STATES, run_real, simulate
from pagedllm.bench.workloads import WorkloadSpec, make_workload

POLICIES = ("paged", "max", "pow2", "oracle")


def _trace(num_requests=6, max_model_len=128):
    return make_workload(WorkloadSpec("sharegpt", num_requests, max_model_len=max_model_len, length_scale=0.15,
                                      seed=3))


@pytest.mark.parametrize("allocator", ["first_fit", "buddy"])
def test_simulated_fractions_sum_to_one_and_order_the_policies(allocator):
    requests = make_workload(WorkloadSpec("sharegpt", 300, max_model_len=1024, seed=1))
    rows = {p: simulate(requests, p, num_blocks=256, max_model_len=1024, allocator=allocator) for p in POLICIES}
    for row in rows.values():
        assert sum(row["fractions"].values()) == pytest.approx(1.0)
        assert all(0.0 <= row["fractions"][s] <= 1.0 for s in STATES)
        assert row["num_output_tokens"] == sum(r.output_len for r in requests)
    useful = {p: rows[p]["fractions"]["useful"] for p in POLICIES}
    assert useful["paged"] > 0.9  # only the tail of each last block is lost
    assert useful["max"] < min(useful["pow2"], useful["oracle"]) and max(useful["pow2"], useful["oracle"]) < useful["paged"]
    if allocator == "first_fit":  # a buddy allocator rounds oracle's exact sizes up to powers of two anyway
        assert useful["pow2"] < useful["oracle"]
    assert rows["paged"]["fractions"]["reservation"] == rows["paged"]["fractions"]["external"] == 0.0
    assert rows["max"]["max_running"] == 256 * 16 // 1024  # max_model_len each: exactly 4 fit
    assert rows["paged"]["mean_running"] > 2 * rows["max"]["mean_running"]


def test_every_policy_gives_paged_outputs_and_the_simulation_matches_the_real_run(tiny_engine_args):
    requests = _trace()
    args = {**tiny_engine_args, "enable_prefix_caching": False}
    real = {p: run_real(requests, p, build_llm(p, **args)) for p in ("max", "paged", "pow2", "oracle")}
    for p in POLICIES:
        assert real[p]["_outputs"] == real["paged"]["_outputs"], f"{p} changed the greedy outputs"
        assert sum(real[p]["fractions"].values()) == pytest.approx(1.0)
        assert real[p]["output_tok_s"] > 0
        sim = simulate(requests, p, num_blocks=tiny_engine_args["num_kv_blocks"],
                       max_model_len=tiny_engine_args["max_model_len"], max_num_seqs=tiny_engine_args["max_num_seqs"],
                       max_num_batched_tokens=tiny_engine_args["max_num_batched_tokens"])
        assert (sim["steps"], sim["max_running"], sim["num_preemptions"]) == (
            real[p]["steps"], real[p]["max_running"], real[p]["num_preemptions"])
        assert sim["fractions"] == pytest.approx(real[p]["fractions"])
    assert real["max"]["max_running"] <= 4 < real["paged"]["max_running"]


def test_a_policy_goes_in_through_the_engine_cores_injection_point(tiny_engine_args):
    from pagedllm import SamplingParams
    from pagedllm.bench.contiguous_allocator import ContiguousKVCacheManager

    llm = build_llm("pow2", "buddy", **tiny_engine_args)
    core = llm.engine.core
    kv = core.kv_cache_manager
    assert core.scheduler.kv is kv
    assert isinstance(kv, ContiguousKVCacheManager) and kv.policy == "pow2" and kv.allocator_name == "buddy"
    assert kv.num_blocks == core.kv_info.num_blocks == tiny_engine_args["num_kv_blocks"]
    out = llm.generate([{"prompt_token_ids": [200, 300, 400]}], SamplingParams(max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert core.check_kv_leaks() == []
    assert llm.engine.stats().num_evictions == 0


def test_a_benchmark_engine_built_for_swap_swaps(tiny_engine_args):
    # The old bench rebuilt the Scheduler after construction without its preemption mode, so a
    # paged run after a baseline silently recomputed. Built through the injection point, every
    # engine argument holds: under memory pressure this engine swaps.
    args = {**tiny_engine_args, "enable_prefix_caching": False, "num_kv_blocks": 12,
            "preemption_mode": "swap", "swap_space": "64MiB"}
    requests = make_workload(WorkloadSpec("fixed", 6, max_model_len=128, input_len=40, output_len=40))
    llms = {p: build_llm(p, **args) for p in ("max", "paged")}
    for llm in llms.values():
        assert llm.engine.core.scheduler.preemption_mode == "swap"
    rows = {p: run_real(requests, p, llm) for p, llm in llms.items()}
    assert rows["paged"]["num_preemptions"] > 0, "the run was meant to preempt"
    assert rows["paged"]["num_swap_outs"] == rows["paged"]["num_preemptions"]
    assert rows["max"]["num_swap_outs"] == 0  # contiguous regions cannot swap: they recompute
    assert rows["max"]["_outputs"] == rows["paged"]["_outputs"]
