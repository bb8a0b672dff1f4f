"""Beam search beside ordinary requests in the same batches, under KV pressure: beam groups are
preempted whole and resumed (recompute, chunked recompute, swap), and every group still equals
Hugging Face `generate(num_beams=k)` beam for beam, while every greedy request equals its solo run."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSequence, beam_sampling_params
from pagedllm.sampling_params import BeamSearchParams
from tests.engine.test_beam_search import (  # noqa: F401  (fixtures)
    assert_same_beams,
    hf_beam_search,
    one_torch_thread,
    tiny_setup,
)


class _Beams:
    def __init__(self, sequences):
        self.sequences = sequences


def beams_of(output, length_penalty: float) -> _Beams:
    """A generate() output of a beam-search request, as the beams assert_same_beams compares."""
    return _Beams([BeamSequence(list(c.token_ids), c.text, c.cumulative_logprob,
                                c.cumulative_logprob / len(c.token_ids) ** length_penalty, c.finish_reason)
                   for c in output.outputs])


def _mixed_workload(prompts):
    """Greedy and beam requests interleaved, so beam groups are often the newest (preempted first)."""
    rng = random.Random(7)
    beam_params = [BeamSearchParams(3, max_tokens=10), BeamSearchParams(2, max_tokens=12, length_penalty=0.5),
                   BeamSearchParams(4, max_tokens=8, early_stopping=True, num_return_sequences=2)]
    inputs, params, kinds = [], [], []
    for i in range(6):
        greedy_prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(8, 24))]
        inputs.append({"prompt_token_ids": greedy_prompt})
        params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        kinds.append(None)
        if i < len(beam_params):
            inputs.append({"prompt_token_ids": prompts[i]})
            params.append(beam_sampling_params(beam_params[i]))
            kinds.append(beam_params[i])
    return inputs, params, kinds


@pytest.mark.parametrize("engine", [
    dict(preemption_mode="recompute"),
    dict(preemption_mode="recompute", max_num_batched_tokens=10),  # resumed groups recompute in chunks
    dict(preemption_mode="swap"),
], ids=["recompute", "chunked-recompute", "swap"])
def test_beam_groups_and_greedy_requests_share_batches_under_kv_pressure(tiny_setup, engine):
    hf_model, path, prompts, eos = tiny_setup
    inputs, params, kinds = _mixed_workload(prompts)
    llm = LLM(model=path, block_size=4, num_kv_blocks=40, **engine)
    core = llm.engine.core
    batch_kinds = []  # per step: (beam rows, other rows) scheduled together
    core.step_listeners.append(lambda sched, _: batch_kinds.append((
        sum(r.startswith("beam:") for r in sched.num_scheduled_tokens),
        sum(not r.startswith("beam:") for r in sched.num_scheduled_tokens))))
    outputs = llm.generate(inputs, params, use_tqdm=False)

    stats = core.stats()
    assert stats.num_beam_group_preemptions > 0, "the cache was meant to be too small for every request at once"
    if engine["preemption_mode"] == "swap":
        assert stats.num_swap_outs > 0
    assert any(beams and others for beams, others in batch_kinds), "beams never shared a batch with others"
    assert stats.num_beam_groups == stats.num_beams_running == 0
    assert core.check_kv_leaks() == []

    solo = LLM(model=path, block_size=4, num_kv_blocks=512)
    for i, (inp, p, kind, out) in enumerate(zip(inputs, params, kinds, outputs)):
        if kind is None:
            (alone,) = solo.generate([inp], p, use_tqdm=False)
            assert out.outputs[0].token_ids == alone.outputs[0].token_ids, f"greedy request {i} changed"
            continue
        assert len(out.outputs) == kind.num_returned
        hf_tokens, hf_scores = hf_beam_search(hf_model, inp["prompt_token_ids"], kind, eos)
        assert_same_beams(beams_of(out, kind.length_penalty), hf_tokens, hf_scores, kind.length_penalty,
                          f"{engine} request {i} {kind}")


def test_a_beam_group_is_preempted_and_readmitted_whole(tiny_setup):
    """After every step, a group's beams are all running or all waiting, and no beam is scheduled
    without its siblings."""
    _, path, prompts, _ = tiny_setup
    inputs, params, _ = _mixed_workload(prompts)
    llm = LLM(model=path, block_size=4, num_kv_blocks=40)
    core = llm.engine.core
    scheduler = core.scheduler
    checked = []
    saved = []

    def check(sched, _):
        stats = core.stats()
        assert stats.num_beams_running == sum(len(g.beam_req_ids) for g in core.beams.groups.values())
        assert stats.num_beam_groups == len(core.beams.groups)
        saved.append(stats.num_beam_kv_blocks_saved)
        for group in core.beams.groups.values():
            beams = [scheduler.requests[r] for r in group.beam_req_ids]
            states = {b.status for b in beams}
            assert len(states) == 1, f"{group.req_id}: beams in states {states}"
            ran = {r in sched.num_scheduled_tokens for r in group.beam_req_ids}
            assert len(ran) == 1, f"{group.req_id}: only some beams were scheduled"
            checked.append(len(beams))

    core.step_listeners.append(check)
    llm.generate(inputs, params, use_tqdm=False)
    assert max(checked) > 1 and core.stats().num_beam_group_preemptions > 0
    assert max(saved) > 0, "the beams were meant to share blocks"
    assert core.check_kv_leaks() == []
