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
    llm = build_llm(**{**tiny_engine_args, "enable_prefix_caching": False})
    real = {p: run_real(requests, p, llm) for p in ("max", "paged", "pow2", "oracle")}  # back to paged in between
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


def test_the_engine_selects_a_policy_from_engine_args(tiny_engine_args):
    from pagedllm import LLM, SamplingParams
    from pagedllm.core.contiguous_allocator import ContiguousKVCacheManager

    llm = LLM(**tiny_engine_args, kv_allocation_policy="pow2", kv_allocator="buddy")
    kv = llm.engine.core.scheduler.kv
    assert isinstance(kv, ContiguousKVCacheManager) and kv.policy == "pow2" and kv.allocator_name == "buddy"
    out = llm.generate([{"prompt_token_ids": [200, 300, 400]}], SamplingParams(max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert llm.engine.core.check_kv_leaks() == []
