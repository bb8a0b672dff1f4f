"""Speculative decoding with a draft model never changes greedy outputs: the same engine with and without
it, token for token, batched, chunked, preempted (recompute and swap), with prefix caching and n > 1.

Three drafts of the tiny copy model (tests/engine/test_spec_decode.py) exercise both paths:
- `same`: the target itself, so nearly every proposal is kept; it also checks the draft's KV
  bookkeeping (catch-up after full acceptance, swaps, copy-on-write): a draft reading stale KV would
  disagree with the target and the acceptance would drop;
- `cut`: its first layer only (model/truncate.py): proposals are often kept and often rejected;
- `random`: an unrelated random model with the same vocabulary: nearly everything is rejected.
"""

from __future__ import annotations

import argparse

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ModelLoadError
from pagedllm.model.truncate import write_truncated_model
from tests.engine.test_spec_decode import CONFIGS, GREEDY, _prompts, _run, copy_model_dir  # noqa: F401 - fixture
from tests.model.tiny_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def drafts(copy_model_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("drafts")
    random_dir = root / "random"
    save_hf_model(make_hf_model("llama", seed=11, max_position_embeddings=1024, num_hidden_layers=1), random_dir)
    return {"same": copy_model_dir, "cut": str(write_truncated_model(copy_model_dir, root / "cut", 1)),
            "random": str(random_dir)}


def _spec(draft: str, k: int) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def baseline(copy_model_dir):  # noqa: F811
    return _run(LLM(model=copy_model_dir), GREEDY)


def _acceptance(llm: LLM) -> float:
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0, "nothing was proposed"
    return stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_identical_for_each_k(copy_model_dir, drafts, baseline, k):  # noqa: F811
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["cut"], k))
    assert _run(llm, GREEDY) == baseline
    stats = llm.engine.core.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, "both paths must run"
    assert len(stats.spec_accepted_per_position) == k
    assert sum(stats.spec_proposed_per_position) == stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.spec_num_bonus_tokens <= stats.spec_num_steps


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_draft_equal_to_the_target_is_almost_always_right(copy_model_dir, drafts, baseline, k):  # noqa: F811
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["same"], k))
    assert _run(llm, GREEDY) == baseline
    assert _acceptance(llm) > 0.97  # float noise of other batch shapes may flip a rare near-tie


def test_an_unrelated_draft_is_rejected_and_changes_nothing(copy_model_dir, drafts, baseline):  # noqa: F811
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["random"], 4))
    assert _run(llm, GREEDY) == baseline
    assert _acceptance(llm) < 0.2


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_under_memory_and_budget_pressure(copy_model_dir, drafts, name):  # noqa: F811
    config = CONFIGS[name]
    reference = _run(LLM(model=copy_model_dir, **config), GREEDY)
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["cut"], 4), **config)
    assert _run(llm, GREEDY) == reference
    stats = llm.engine.core.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if "preemption" in name:
        assert stats.num_preemptions > 0, "the configuration was meant to preempt"
    if name == "swap-preemption":
        assert stats.num_swap_outs > 0
    # The same draft as the target: its KV must survive chunking, prefix hits, swaps and recomputation.
    same = LLM(model=copy_model_dir, speculative_config=_spec(drafts["same"], 3), **config)
    assert _run(same, GREEDY) == reference
    assert _acceptance(same) > 0.95
    if name == "swap-preemption":
        assert same.engine.core.stats().num_swap_outs > 0


def test_greedy_identical_with_parallel_samples(copy_model_dir, drafts):  # noqa: F811
    params = SamplingParams(n=3, temperature=0, max_tokens=40, ignore_eos=True)
    reference = _run(LLM(model=copy_model_dir), params)
    for name, bar in (("cut", 0.0), ("same", 0.95)):
        llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts[name], 3))
        assert _run(llm, params) == reference
        assert _acceptance(llm) > bar


def test_stop_tokens_min_tokens_and_logprobs_as_without(copy_model_dir, drafts, baseline):  # noqa: F811
    stops = sorted({seq[0][10] for seq in baseline[:4]} | {seq[0][20] for seq in baseline[4:]})
    params = [SamplingParams(temperature=0, max_tokens=5 + 7 * i, stop_token_ids=stops, min_tokens=3 * (i % 3),
                             logprobs=2) for i in range(len(_prompts()))]
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    plain = LLM(model=copy_model_dir).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["cut"], 5))
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.check_kv_leaks() == []
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-3 for t in la)
    assert {o.outputs[0].finish_reason for o in spec} == {"stop", "length"}


def test_seeded_sampling_is_reproducible_with_a_draft(copy_model_dir, drafts):  # noqa: F811
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=32, seed=i, ignore_eos=True) for i in range(6)]
    runs = []
    for _ in range(2):
        llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["cut"], 3))
        runs.append(_run(llm, params, _prompts(6)))
        assert llm.engine.core.stats().spec_num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_refusals(copy_model_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=copy_model_dir, speculative_config=_spec(str(tmp_path / "nowhere"), 3))
    with pytest.raises(ValueError, match='needs "model"'):
        LLM(model=copy_model_dir, speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="only read by"):
        LLM(model=copy_model_dir, speculative_config={"method": "ngram", "model": copy_model_dir})
    other_vocab = save_hf_model(make_hf_model("llama", num_hidden_layers=1, vocab_size=300), tmp_path / "v300")
    with pytest.raises(ModelLoadError, match="vocabulary of 300"):
        LLM(model=copy_model_dir, speculative_config=_spec(other_vocab, 3))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(model=copy_model_dir, tensor_parallel_size=2, device="cpu", speculative_config=_spec(copy_model_dir, 3))


def test_a_failing_draft_model_costs_acceptance_not_requests(copy_model_dir, drafts, baseline, monkeypatch):  # noqa: F811
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["same"], 3))
    draft = llm.engine.core.executor.runner.draft
    calls = {"n": 0}
    forward = draft.model.forward

    def sometimes_fails(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 5 == 0:
            raise RuntimeError("draft out of memory")
        return forward(*args, **kwargs)

    monkeypatch.setattr(draft.model, "forward", sometimes_fails)
    assert _run(llm, GREEDY) == baseline
    assert draft.num_failures > 0
    assert 0 < llm.engine.core.stats().spec_num_accepted_tokens < llm.engine.core.stats().spec_num_draft_tokens


def test_the_cli_flag_takes_a_draft_model(copy_model_dir):  # noqa: F811
    from pagedllm.config import EngineArgs, SpeculativeConfig

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config",
                              f'{{"method": "draft_model", "model": "{copy_model_dir}", "num_speculative_tokens": 2}}'])
    assert EngineArgs.from_cli_args(args).speculative() == SpeculativeConfig("draft_model", 2, model=copy_model_dir)


def test_draft_with_a_16_bit_kv_cache(copy_model_dir, drafts):  # noqa: F811
    """Both caches take the float16 element type; the draft that is the target keeps nearly everything,
    which it could not if its cache were read back in another type than it was written in."""
    plain = _run(LLM(model=copy_model_dir, kv_cache_dtype="float16"), GREEDY)
    llm = LLM(model=copy_model_dir, kv_cache_dtype="float16", speculative_config=_spec(drafts["same"], 3))
    assert _run(llm, GREEDY) == plain
    assert _acceptance(llm) > 0.95


class _DraftLog:
    """Per step of an engine with a draft model: whether the gate was open, whether the draft kept up
    with prompts, who proposed, whether a prompt chunk ran, and the token counts of every draft pass
    (rows of the first one: catch-ups)."""

    def __init__(self, llm: LLM, monkeypatch, close_at: int | None = None, close_for: int = 0) -> None:
        core = llm.engine.core
        self.draft = draft = core.executor.runner.draft
        self.steps: list[dict] = []
        propose, forward, schedule = draft.propose, draft._forward, core.scheduler.schedule
        calls = {"schedule": 0}

        def closing_schedule():
            if calls["schedule"] == close_at:  # as the gate does after failures: no proposal for a while
                core.scheduler.spec._gate.closed_steps = close_for
            calls["schedule"] += 1
            return schedule()

        def logged_propose(states, sched, prepare_inputs):
            self.steps.append(dict(open=core.scheduler.spec.step_open, keep_up=sched.draft_keep_up,
                                   proposing=dict(sched.num_draft_tokens),
                                   prompt=any(n > 1 and r not in sched.num_draft_tokens
                                              for r, n in sched.num_scheduled_tokens.items()),
                                   passes=[]))
            return propose(states, sched, prepare_inputs)

        def logged_forward(prepare, rows, counts):
            self.steps[-1]["passes"].append(list(counts))
            return forward(prepare, rows, counts)

        monkeypatch.setattr(core.scheduler, "schedule", closing_schedule)
        monkeypatch.setattr(draft, "propose", logged_propose)
        monkeypatch.setattr(draft, "_forward", logged_forward)


def test_a_closed_gate_runs_no_draft_pass_not_even_over_prompts(copy_model_dir, drafts, baseline, monkeypatch):  # noqa: F811
    # Two requests at a time: prompts keep arriving while the useless draft has the gate closed.
    reference = _run(LLM(model=copy_model_dir, max_num_seqs=2), GREEDY)
    llm = LLM(model=copy_model_dir, max_num_seqs=2, speculative_config=_spec(drafts["random"], 4))
    log = _DraftLog(llm, monkeypatch)
    assert _run(llm, GREEDY) == reference == baseline
    closed = [s for s in log.steps if not s["open"]]
    assert any(s["prompt"] for s in closed), "no prompt arrived while the gate was closed"
    assert all(not s["passes"] and not s["proposing"] for s in closed)
    assert len(closed) > 0.8 * len(log.steps)  # the gate closed for a draft this bad
    # Once it has closed, the steps it lets through are probes: the draft runs for their proposers
    # alone (one proposal each), over no prompt.
    probes = [s for s in log.steps if s["open"] and not s["keep_up"]]
    assert any(s["prompt"] for s in probes) and any(s["proposing"] for s in probes)
    for s in probes:
        assert set(s["proposing"].values()) <= {1} and len(s["passes"]) == (1 if s["proposing"] else 0)
        assert all(len(counts) == len(s["proposing"]) for counts in s["passes"])
    assert log.draft.num_forward_passes == sum(len(s["passes"]) for s in log.steps)


def test_forcing_the_gate_shut_silences_the_draft_entirely(copy_model_dir, drafts, baseline, monkeypatch):  # noqa: F811
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["same"], 3))
    _DraftLog(llm, monkeypatch, close_at=0, close_for=10**6)
    assert _run(llm, GREEDY) == baseline
    assert llm.engine.core.executor.runner.draft.num_forward_passes == 0
    assert llm.engine.core.stats().spec_num_draft_tokens == 0


@pytest.mark.parametrize("close_for", [10, 40])
def test_after_the_gate_reopens_lagging_requests_catch_up_at_most_max_catch_up(
        copy_model_dir, drafts, baseline, monkeypatch, close_for):  # noqa: F811
    """Every request is past its prompt when the gate closes; when it reopens, each proposing request
    computes its missing draft KV: all of it after 10 steps (the draft that is the target keeps
    agreeing), only the last MAX_CATCH_UP positions after 40 (stale KV before them: outputs unchanged)."""
    from pagedllm.worker.draft_proposer import MAX_CATCH_UP

    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)  # still running when it reopens
    reference = _run(LLM(model=copy_model_dir), params)
    llm = LLM(model=copy_model_dir, speculative_config=_spec(drafts["same"], 3))
    log = _DraftLog(llm, monkeypatch, close_at=4, close_for=close_for)
    assert _run(llm, params) == reference
    reopened = next(i for i, s in enumerate(log.steps) if i > 4 and s["open"])
    assert reopened == 4 + close_for
    assert not any(s["passes"] for s in log.steps[4:reopened])
    catch_up = log.steps[reopened]["passes"][0]
    assert len(catch_up) == len(log.steps[reopened]["proposing"]) > 0
    # Each closed step left one token's draft KV behind; the step before the gate closed may have
    # kept all its proposals (one more), and the last sampled token is this step's own.
    assert all(min(close_for + 1, MAX_CATCH_UP + 1) <= n <= min(close_for + 2, MAX_CATCH_UP + 1) for n in catch_up)
    if close_for < MAX_CATCH_UP:
        assert _acceptance(llm) > 0.95  # caught up fully: the draft still agrees with the target


def test_a_good_draft_speculates_on_nearly_every_step(copy_model_dir, drafts, baseline, monkeypatch):  # noqa: F811
    llm = LLM(model=copy_model_dir, max_num_seqs=4, speculative_config=_spec(drafts["same"], 4))
    log = _DraftLog(llm, monkeypatch)
    assert _run(llm, GREEDY) == baseline
    assert all(s["open"] for s in log.steps)
    with_decodes = [s for s in log.steps if not s["prompt"] or s["proposing"]]
    assert sum(bool(s["proposing"]) for s in with_decodes) >= 0.9 * len(with_decodes)
    assert _acceptance(llm) > 0.97
