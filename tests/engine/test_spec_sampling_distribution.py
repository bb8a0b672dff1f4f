"""Sampled requests keep their output distribution under speculation (n-gram, and a draft model cut from
the target: greedy proposals, q = one-hot, verified by the same rejection sampler): on the tiny copy
model, the joint distribution of a request's output tokens 2 and 3 (verified in one speculative step)
with speculation matches the one without (two-sample chi-square over many seeded requests).

False-failure rate: each test fails with probability ALPHA = 1e-3 for a correct sampler (the seeds are
fixed, so a run is deterministic). Power: a sampler that forgets to remove the rejected proposal from
the residual distribution scored p = 1.5e-7 here (checked by hand when the test was written)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.truncate import write_truncated_model
from tests.engine.test_spec_decode import copy_model, copy_model_dir  # noqa: F401 - fixture

ALPHA = 1e-3
NUM_REQUESTS = 1500


def two_sample_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test of homogeneity of two samples over their cells (cells with < 10 in total pooled)."""
    cells = [c for c in set(a) | set(b) if a[c] + b[c] >= 10]
    rest = [c for c in set(a) | set(b) if a[c] + b[c] < 10]
    rows = [[a[c] for c in cells] + [sum(a[c] for c in rest)], [b[c] for c in cells] + [sum(b[c] for c in rest)]]
    if not rest:
        rows = [r[:-1] for r in rows]
    n_a, n_b = sum(rows[0]), sum(rows[1])
    statistic = 0.0
    for j in range(len(rows[0])):
        total = rows[0][j] + rows[1][j]
        for row, n in ((rows[0], n_a), (rows[1], n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (row[j] - expected) ** 2 / expected
    df = len(rows[0]) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _cycle_prompt(length: int = 16) -> list[int]:
    """A prompt that follows the copy model's own successor map, so the model tends to continue it and
    the n-gram proposer has the continuation at hand."""
    model = copy_model()
    with torch.no_grad():
        token = 17
        prompt = [token]
        for _ in range(length - 1):
            logits = model(torch.tensor([prompt])).logits[0, -1]
            token = int(logits.argmax())
            prompt.append(token)
    return prompt


def _tails(llm: LLM, prompt: list[int], offset: int) -> Counter:
    params = [SamplingParams(temperature=2.0, top_k=3, max_tokens=3, seed=offset + i, ignore_eos=True)
              for i in range(NUM_REQUESTS)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_REQUESTS, params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outputs)


@pytest.fixture(scope="module")
def plain_tails(copy_model_dir):  # noqa: F811
    return _tails(LLM(model=copy_model_dir, max_num_seqs=256), _cycle_prompt(), offset=0)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_distribution_unchanged_by_speculation(copy_model_dir, plain_tails, method, tmp_path):  # noqa: F811
    prompt = _cycle_prompt()
    plain = plain_tails
    config = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        config["model"] = str(write_truncated_model(copy_model_dir, tmp_path / "draft", 1))
    llm = LLM(model=copy_model_dir, max_num_seqs=256, speculative_config=config)
    spec = _tails(llm, prompt, offset=100_000)
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens >= NUM_REQUESTS // 2, "too few requests speculated"
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert len(plain) > 5  # a distribution, not a point
    assert two_sample_p_value(plain, spec) > ALPHA
