"""One request that fails while being prepared or sampled fails alone; the others carry on."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model.sampling import metadata as sampling_metadata
from tests.model.tiny_models import make_hf_model, save_hf_model

POISON_SEED = 666


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_hf_model(make_hf_model("llama", seed=2), tmp_path_factory.mktemp("tiny-failure"))
    return LLM(model=path)


def test_a_failing_request_fails_alone(llm, monkeypatch):
    real = sampling_metadata.SamplingMetadata.from_requests

    def failing_for_one_seed(rows, vocab_size, device):
        if any(row.params.seed == POISON_SEED for row in rows):
            raise RuntimeError("injected sampling failure")
        return real(rows, vocab_size, device)

    # Fault injection at the sampler boundary: the runner, scheduler and engine are all real.
    monkeypatch.setattr(sampling_metadata.SamplingMetadata, "from_requests", staticmethod(failing_for_one_seed))
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) for _ in range(4)]
    params[2] = SamplingParams(temperature=0.5, max_tokens=6, seed=POISON_SEED, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    failed = outputs[2].outputs[0]
    assert failed.finish_reason == "abort"
    assert failed.error == "RuntimeError: injected sampling failure"
    for i in (0, 1, 3):
        assert outputs[i].outputs[0].finish_reason == "length"
        assert len(outputs[i].outputs[0].token_ids) == 6
    monkeypatch.undo()
    alone = llm.generate(prompts[0], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[0].outputs[0].token_ids == alone  # the retry left no trace in the others' outputs
    assert llm.engine.core.check_kv_leaks() == []
