"""Every supported architecture beyond Llama/Qwen2 (tests/engine/test_hf_equivalence.py has those),
through the engine: greedy outputs token for token equal to Hugging Face transformers on the same
tiny random weights, logprobs within 1e-3, batched, with chunked prefill, with preemption and with
prefix caching (a second pass over the same prompts served from cached blocks).

Windowed models (Mistral, Mixtral, Gemma) use a window of 16 and prompts up to 8x that, so most
queries have keys outside their window; ``test_window_is_exercised`` checks the window changes
HF's own outputs on these prompts (else the equality above would not test it).

Near-ties: random tiny models are drawn with large weights (tiny_models.py) so greedy choices are
decisive; a differing token is tolerated only as tests/hf_reference.py's near-tie rule says (both
in HF's top 5, HF logprobs within 1e-4), and at most one prompt of a run may end that way.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.tiny_models import WINDOW, make_hf_model, save_hf_model

MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = [1, 5, 16, 17, 33, 47, 64, 100, 129]

KINDS = {  # tiny model kind -> the class the registry must pick
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_moe_unnormalized": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mistral_window": "LlamaForCausalLM",
}
WINDOWED = {"mixtral", "gemma2", "gemma3", "mistral_window"}
ALL_WINDOWED = {"mixtral", "mistral_window"}
"""Every layer windowed: blocks behind the window are freed, so preemption needs a smaller cache."""


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    shared = [rng.randrange(3, vocab_size) for _ in range(48)]  # two prompts share 3 blocks
    prompts += [shared + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 21)]
    return prompts


@pytest.fixture(scope="module", params=sorted(KINDS))
def setup(request, tmp_path_factory):
    kind = request.param
    hf_model = make_hf_model(kind, seed=1, max_position_embeddings=1024)
    hf_model.generation_config.eos_token_id = None
    path = save_hf_model(hf_model, tmp_path_factory.mktemp(kind))
    prompts = _prompts(hf_model.config.vocab_size)
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    return kind, hf_model, path, prompts, references


def _check(llm, prompts, references, label) -> None:
    results = engine_greedy(llm, prompts, MAX_NEW_TOKENS)
    verdicts = [assert_matches_reference(ids, logprobs, ref, f"{label}, prompt of {len(p)} tokens")
                for p, ref, (ids, logprobs) in zip(prompts, references, results)]
    assert verdicts.count("exact") >= len(verdicts) - 1, verdicts
    assert llm.engine.core.check_kv_leaks() == []


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="one-batch"),
        # a small odd step budget puts every long prompt through chunked prefill
        pytest.param(dict(max_num_batched_tokens=37), id="chunked-prefill"),
        pytest.param(dict(block_size=16, num_kv_blocks=14, max_num_batched_tokens=64), id="preemption"),
    ],
)
def test_matches_hf(setup, engine_kwargs):
    kind, _, path, prompts, references = setup
    if kind in ALL_WINDOWED and "num_kv_blocks" in engine_kwargs:  # 2 blocks a decoding request, not 9
        engine_kwargs = {**engine_kwargs, "num_kv_blocks": 5, "max_num_batched_tokens": 16}
    llm = LLM(model=path, **engine_kwargs)
    assert type(llm.engine.core.executor.runner.model).__name__ == KINDS[kind]
    # blocks are freed behind the window only where every layer has it (Gemma's global layers read them all)
    assert llm.engine.core.kv_cache_manager.sliding_window == (WINDOW if kind in ALL_WINDOWED else None)
    _check(llm, prompts, references, f"{kind} {engine_kwargs}")
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.core.scheduler.num_preemptions > 0, "the run was meant to preempt"


def test_prefix_cache_hits_match_hf(setup):
    kind, _, path, prompts, references = setup
    llm = LLM(model=path, max_num_batched_tokens=37)
    _check(llm, prompts, references, f"{kind} first pass")
    params = SamplingParams(temperature=0, max_tokens=1)
    cached = [out.num_cached_tokens
              for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert sum(cached) >= 16 * 8, f"the second pass was meant to hit the prefix cache: {cached}"
    _check(llm, prompts, references, f"{kind} served from the prefix cache")


def test_every_registered_architecture_is_verified(capsys):
    """No architecture is registered without an HF-equality test and its line in ``pagedllm models``."""
    from pagedllm.entrypoints.cli import main
    from pagedllm.model.registry import VERIFIED_BY, supported_architectures

    tested_elsewhere = {"LlamaForCausalLM", "Qwen2ForCausalLM"}  # tests/engine/test_hf_equivalence.py
    tested_elsewhere |= {"LlamaModel", "Qwen2Model", "Qwen3Model"}  # pooled: tests/engine/test_embeddings.py
    tested_elsewhere |= {"BertModel", "RobertaModel", "XLMRobertaModel"}  # tests/engine/test_encoders.py
    tested_elsewhere |= {f"{family}ForSequenceClassification" for family in ("Bert", "Roberta", "XLMRoberta")}
    tested_here = set(KINDS.values()) | {"MistralForCausalLM"}  # mistral_window: MistralConfig
    assert set(supported_architectures()) == (tested_here - {"LlamaForCausalLM"}) | tested_elsewhere
    assert set(VERIFIED_BY) == set(supported_architectures())
    assert main(["models"]) == 0
    listed = capsys.readouterr().out
    assert all(arch in listed for arch in supported_architectures())


@pytest.mark.parametrize("setup", sorted(WINDOWED), indirect=True)  # the windowed kinds' setups only
def test_window_is_exercised(setup):
    """The window changes HF's greedy outputs on these prompts, so matching HF tests it."""
    kind, hf_model, _, prompts, references = setup
    assert hf_model.config.sliding_window == WINDOW
    full = make_hf_model(kind, seed=1, max_position_embeddings=1024, sliding_window=4096)
    full.generation_config.eos_token_id = None
    long_prompts = [(p, r) for p, r in zip(prompts, references) if len(p) > 2 * WINDOW]
    differing = [p for p, ref in long_prompts if hf_greedy(full, p, MAX_NEW_TOKENS).token_ids != ref.token_ids]
    assert len(differing) >= len(long_prompts) // 2, "the window barely changes outputs: the test would miss it"


def test_phi3_longrope_rotation_by_position():
    """longrope: positions below original_max_position_embeddings rotate by the short factors (as HF
    does for any sequence shorter than that), positions from it on by the long ones (as HF does
    once a sequence is longer; HF then re-rotates the whole sequence, which a KV cache cannot)."""
    from pagedllm.model.layers.rotary import RotaryEmbedding

    hf_model = make_hf_model("phi3", seed=1)
    config = hf_model.config
    original = config.rope_parameters["original_max_position_embeddings"]
    ours = RotaryEmbedding(config, config.hidden_size // config.num_attention_heads)
    x = torch.zeros(1, 1, 1)
    with torch.no_grad():
        short_cos, _ = hf_model.model.rotary_emb(x, torch.arange(original)[None])
        long_cos, _ = hf_model.model.rotary_emb(x, torch.arange(original + 64)[None])
    torch.testing.assert_close(ours.cos_cache[:original], short_cos[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.cos_cache[original : original + 64], long_cos[0, original:], atol=1e-5, rtol=0)
    assert not torch.allclose(short_cos[0, 1:], long_cos[0, 1:original], atol=1e-3)  # the factors differ
