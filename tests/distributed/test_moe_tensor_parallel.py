"""Mixture-of-experts under tensor parallelism (experts sliced along their intermediate dimension,
model/layers/moe.py): at N=2, tiny Qwen3-MoE (with a dense layer among the sparse ones) and Mixtral
give the unsharded engine's and Hugging Face's greedy outputs, with chunked prefill and preemption;
a Q8_0 GGUF Mixtral, its experts kept quantized on each rank, gives the unsharded quantized engine's."""

from __future__ import annotations

import random

import pytest

from gguf import GGMLQuantizationType

from pagedllm import LLM
from pagedllm.model.layers import quantized
from tests.model.gguf_writer_helpers import write_converted_gguf
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.tiny_models import make_hf_model, save_hf_model

pytestmark = pytest.mark.slow  # two worker processes per engine

MAX_NEW_TOKENS = 8
PRESSURE = dict(max_num_batched_tokens=37, block_size=8, num_kv_blocks=14)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_tp2_matches_unsharded_and_hf(kind, tmp_path):
    # no window: a windowed Mixtral frees blocks behind it and would not preempt in this cache (windows under
    # tensor parallelism: tests/engine/test_sliding_window_blocks.py)
    hf_model = make_hf_model(kind, seed=4, max_position_embeddings=512,
                             **({"sliding_window": None} if kind == "mixtral" else {}))
    hf_model.generation_config.eos_token_id = None
    path = save_hf_model(hf_model, tmp_path / kind)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 6, 17, 40, 70)]
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    unsharded = engine_greedy(LLM(model=path, **PRESSURE), prompts, MAX_NEW_TOKENS)

    llm = LLM(model=path, tensor_parallel_size=2, **PRESSURE)
    try:
        assert not hasattr(llm.engine.core.executor, "runner")  # the ranks run the model, not this process
        results = engine_greedy(llm, prompts, MAX_NEW_TOKENS)
        assert llm.engine.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
        assert llm.engine.core.check_kv_leaks() == []
    finally:
        llm.engine.core.shutdown()
    assert [ids for ids, _ in results] == [ids for ids, _ in unsharded], f"{kind}: differs from the unsharded engine"
    for (_, logprobs), (_, expected) in zip(results, unsharded):
        assert logprobs == pytest.approx(expected, abs=1e-4), kind
    verdicts = [assert_matches_reference(ids, lp, ref, f"{kind} N=2, prompt {i}")
                for i, ((ids, lp), ref) in enumerate(zip(results, references))]
    assert verdicts.count("exact") >= len(verdicts) - 1, verdicts


@pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")
def test_quantized_moe_gguf_tp2_matches_unsharded(tmp_path, monkeypatch):
    """Mixtral's experts of intermediate 128: each rank's 64 gate/up rows and 64 down columns are
    whole Q8_0 blocks, so every rank keeps its expert slices quantized (and quantizes its own 32-wide
    blocks of x for the int8 kernel)."""
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-mixtral-Q8_0.gguf"
    write_converted_gguf(make_hf_model("mixtral", seed=4, sliding_window=None), path, GGMLQuantizationType.Q8_0)
    prompts = [list(range(3, 20)), [7, 8, 9], list(range(100, 140))]
    single = LLM(model=str(path), num_kv_blocks=64)
    moe = single.engine.core.executor.runner.model.model.layers[0].mlp
    assert moe.experts.quant[0] is not None and moe.experts.quant[1] is not None
    if quantized.int8_kernel_available():  # the default: the experts take int8 activations, on every rank too
        assert moe.experts.quant[0][0].kernel_type == quantized.INT8_KERNEL_TYPE[quantized.Q8_0]
    expected = engine_greedy(single, prompts, MAX_NEW_TOKENS)
    del single
    sharded = LLM(model=str(path), tensor_parallel_size=2, num_kv_blocks=64, distributed_timeout=60)
    try:
        assert sharded.engine.core.executor.gguf_path == str(path.resolve())  # the ranks read the GGUF
        results = engine_greedy(sharded, prompts, MAX_NEW_TOKENS)
    finally:
        sharded.engine.core.shutdown()
    assert [ids for ids, _ in results] == [ids for ids, _ in expected]
    for (_, logprobs), (_, ref) in zip(results, expected):
        assert logprobs == pytest.approx(ref, abs=1e-4)
