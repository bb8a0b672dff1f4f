"""The batch-invariant mode under schedules the other tests fix: speculative decoding (n-gram, and a
draft model) stays lossless in it (greedy tokens equal, and the accepted tokens' logprobs bitwise
equal, to the run without speculation, in batches of several sizes), and a hypothesis search over
random schedules (the target's arrival position, its neighbours' prompts and lengths, the chunk
budget, max_num_seqs, prefix caching, threads) finds no schedule under which one request's
logprobs differ from its solo run."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.model.attention import cpu_op
from pagedllm.model.truncate import write_truncated_model
from tests.engine.test_spec_decode import copy_model
from tests.model.tiny_models import save_hf_model

pytestmark = pytest.mark.skipif(not cpu_op.load(), reason="the mode needs the compiled CPU ops")

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def copy_dir(tmp_path_factory) -> str:
    """test_spec_decode's copy model (proposals often accepted, often rejected) with head_dim 32,
    which the compiled attention op takes (the mode refuses the torch reference's 16)."""
    return save_hf_model(copy_model(head_dim=32), tmp_path_factory.mktemp("tiny-copy-bi"))


def _prompt(rng: random.Random, length: int) -> list[int]:
    body = [rng.randrange(3, 500) for _ in range(length)]
    return body + body[:4]


TARGET = _prompt(random.Random(29), 40)


def _run(llm: LLM, neighbours: list[list[int]], lengths: list[int], at: int):
    """(token ids, [(token, its logprob), then the sorted top logprobs] per step) of the target at
    position ``at`` among ``neighbours``."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    inputs = [{"prompt_token_ids": p} for p in neighbours]
    inputs.insert(at, {"prompt_token_ids": TARGET})
    params.insert(at, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2))
    out = llm.generate(inputs, params, use_tqdm=False)[at].outputs[0]
    assert len(out.token_ids) == NUM_TOKENS
    return list(out.token_ids), [[(t, s[t].logprob)] + sorted((k, v.logprob) for k, v in s.items())
                                 for t, s in zip(out.token_ids, out.logprobs)]


def _llm(model: str, **kwargs) -> LLM:
    # A small KV cache: hypothesis builds an engine per example (and more while it shrinks a failure).
    return LLM(model=model, batch_invariant=True,
               **{"block_size": 16, "num_kv_blocks": 256, "enable_prefix_caching": False, **kwargs})


@pytest.fixture(scope="module")
def solo(copy_dir):
    threads = torch.get_num_threads()
    try:
        return _run(_llm(copy_dir, num_threads=1), [], [], 0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [2, 5])
def test_speculative_decoding_stays_lossless(copy_dir, solo, k):
    rng = random.Random(k)
    neighbours = [_prompt(rng, rng.randrange(5, 60)) for _ in range(7)]
    lengths = [rng.randrange(1, 30) for _ in neighbours]
    llm = _llm(copy_dir, num_threads=2, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    assert _run(llm, neighbours, lengths, 3) == solo
    alone = _run(llm, [], [], 0)
    assert alone == solo
    stats = llm.engine.core.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, "both paths were meant to run"


@pytest.fixture(scope="module")
def drafts(copy_dir, tmp_path_factory) -> dict[str, str]:
    """The copy model's first layer (`cut`: proposals often kept, often rejected) and the copy model
    itself (`same`: nearly all kept, so most verify steps score k + 1 rows of a request)."""
    root = tmp_path_factory.mktemp("drafts-bi")
    return {"cut": str(write_truncated_model(copy_dir, root / "cut", 1)), "same": copy_dir}


@pytest.mark.parametrize(("draft", "k", "budget"), [("cut", 2, None), ("cut", 5, 16), ("same", 4, None)])
def test_draft_model_speculation_stays_lossless(copy_dir, drafts, solo, draft, k, budget):
    """A verify step scores k + 1 rows of each proposing request beside other requests' decode rows and
    prompt chunks; the draft (not in the mode) proposes differently in different batches, so the
    target's rows fall into steps of different shapes: its tokens and logprobs stay those of the
    run without speculation."""
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = _llm(copy_dir, num_threads=2, **kwargs,
               speculative_config={"method": "draft_model", "model": drafts[draft], "num_speculative_tokens": k})
    assert _run(llm, [], [], 0) == solo
    for size in (2, 8, 16):
        rng = random.Random(100 * k + size)
        neighbours = [_prompt(rng, rng.randrange(5, 60)) for _ in range(size - 1)]
        lengths = [rng.randrange(1, 30) for _ in neighbours]
        assert _run(llm, neighbours, lengths, rng.randrange(size)) == solo, f"a batch of {size}"
    stats = llm.engine.core.stats()
    assert 0 < stats.spec_num_accepted_tokens, "proposals were meant to be kept"
    if draft == "cut":
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, "and some rejected"


def test_draft_model_speculation_without_the_mode_changes_the_bits(copy_dir, drafts):
    """The comparison above without the mode: speculation alone changes the logprobs (a verify step's
    k + 1 rows take other kernel paths than decode's one), so that test can fail."""
    def plain(**kwargs) -> LLM:
        return LLM(model=copy_dir, block_size=16, num_kv_blocks=256, enable_prefix_caching=False, **kwargs)

    reference = _run(plain(num_threads=1), [], [], 0)
    llm = plain(num_threads=2, speculative_config={"method": "draft_model", "model": drafts["cut"],
                                                   "num_speculative_tokens": 2})
    assert _run(llm, [], [], 0) != reference


schedules = st.fixed_dictionaries({
    "neighbours": st.lists(st.tuples(st.integers(1, 90), st.integers(1, 30)), max_size=12),
    "at": st.integers(0, 12),
    "budget": st.sampled_from([None, 7, 16, 33, 64]),
    "max_num_seqs": st.sampled_from([2, 3, 8, 64]),
    "prefix_caching": st.booleans(),
    "threads": st.sampled_from([1, 2]),
    "seed": st.integers(0, 2**16),
})


@settings(max_examples=10, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schedule=schedules)
def test_random_schedules(copy_dir, solo, schedule):
    rng = random.Random(schedule["seed"])
    neighbours = [_prompt(rng, length) for length, _ in schedule["neighbours"]]
    if schedule["prefix_caching"] and neighbours:  # one neighbour shares the target's first blocks
        neighbours[0] = TARGET[:32] + neighbours[0]
    lengths = [n for _, n in schedule["neighbours"]]
    kwargs = {"max_num_seqs": schedule["max_num_seqs"], "num_threads": schedule["threads"],
              "enable_prefix_caching": schedule["prefix_caching"]}
    if schedule["budget"] is not None:
        kwargs["max_num_batched_tokens"] = schedule["budget"]
    at = min(schedule["at"], len(neighbours))
    assert _run(_llm(copy_dir, **kwargs), neighbours, lengths, at) == solo
