"""The runner builds a request's sampling tensors once, when it arrives, for all of its sequences."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model.sampling import metadata as sampling_metadata
from tests.model.tiny_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = make_hf_model("llama", seed=5, max_position_embeddings=256)
    return LLM(model=save_hf_model(model, tmp_path_factory.mktemp("tiny-tensors")), enable_prefix_caching=False)


def test_logit_bias_and_min_tokens_tensors_are_built_once_per_request(llm, monkeypatch):
    builds = []
    original = sampling_metadata.RequestTensors.build.__func__

    def counting_build(cls, params, eos_token_ids, vocab_size, device):
        builds.append(params)
        return original(cls, params, eos_token_ids, vocab_size, device)

    monkeypatch.setattr(sampling_metadata.RequestTensors, "build", classmethod(counting_build))
    runner = llm.engine.core.executor.runner
    bias = {t: -100.0 for t in range(3, 300)} | {7: 100.0}
    params = SamplingParams(n=8, temperature=1.0, max_tokens=6, min_tokens=3, logit_bias=bias,
                            stop_token_ids=[7], ignore_eos=True, seed=1)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [21, 22]}], [params, plain],
                           use_tqdm=False)
    # 7 is forced by the bias but suppressed until min_tokens, then it stops the sequence
    for seq in outputs[0].outputs:
        assert seq.token_ids[3] == 7 and len(seq.token_ids) == 4 and 7 not in seq.token_ids[:3]
    # one build for the 8 sequences of the biased request, one for the plain request: none per step
    assert len(builds) == 2 and sum(p.logit_bias is bias for p in builds) == 1
    # the runner hears of finished requests at the next step: then their tensors are released
    llm.generate({"prompt_token_ids": [31]}, plain, use_tqdm=False)
    assert len(runner.request_tensors) <= len(runner.requests) <= 1
    assert all(entry[0].logit_bias is not bias for entry in runner.request_tensors._entries.values())
