"""int8 activations end to end: the embedded default model (SmolLM2-135M, Q4_1) with its linears on the
int8-activation kernel (asked for by name: ``auto`` keeps this one model exact, model/activation_format.py)
scores a real text close to the float32-activation path (the quantized weights either way), and the fallback
(no linear it can take) runs the float path unchanged."""

import logging
import math

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.perplexity_text import TEXT
from pagedllm.model.layers import quantized
from pagedllm.model.layers.linear import LinearBase
from tests.hf_reference import engine_greedy
from tests.model.tiny_models import make_hf_model, save_hf_model

needs_kernel = pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable")


def linears(llm):
    return [m for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, LinearBase)]


def scored(llm, token_ids):
    """Each position's (logprob of the text's token, the top-1 token) under teacher forcing."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    result = []
    for entry, token in zip(out.prompt_logprobs[1:], token_ids[1:]):
        top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
        result.append((entry[token].logprob, top))
    return result


@needs_kernel
def test_default_model_with_int8_activations_scores_close_to_float():
    plain = LLM(enable_prefix_caching=False)  # auto: the embedded model keeps float32 activations
    token_ids = plain.get_tokenizer().encode(TEXT)[:256]
    base = scored(plain, token_ids)
    prompts = [token_ids[:40], token_ids[100:130], token_ids[180:190]]
    base_greedy = [ids for ids, _ in engine_greedy(plain, prompts, 16)]
    assert {lin.quant_weight.kernel_type for lin in linears(plain)} == {quantized.Q4_1}
    del plain

    llm = LLM(enable_prefix_caching=False, quant_activations="int8")
    kinds = {lin.quant_weight.kernel_type for lin in linears(llm)}
    assert kinds == {quantized.INT8_KERNEL_TYPE[quantized.Q4_1]}  # every linear on the int8 kernel
    head = llm.engine.core.executor.runner.model.lm_head.quant_weight  # the tied embedding: float activations
    assert head.kernel_type not in quantized.INT8_KERNEL_TYPE.values()
    int8 = scored(llm, token_ids)
    int8_greedy = [ids for ids, _ in engine_greedy(llm, prompts, 16)]
    del llm

    diffs = [abs(a[0] - b[0]) for a, b in zip(base, int8)]
    agree = sum(a[1] == b[1] for a, b in zip(base, int8)) / len(base)
    ppl_base = math.exp(-sum(a[0] for a in base) / len(base))
    ppl_int8 = math.exp(-sum(b[0] for b in int8) / len(int8))
    # Measured (AVX-512 VNNI; docs/quantization.md): mean |d logprob| 0.128, the greedy token at each position of the
    # text the same at 95.7% of them, perplexity 9.088 -> 8.982. The float kernel on the same int8-rounded
    # activations (a fake-quantized x) differs from the float path by as much (0.127): the cost is the
    # rounding of the activations (SmolLM2's outlier channels), not the kernel.
    assert sum(diffs) / len(diffs) < 0.25, sum(diffs) / len(diffs)
    assert agree > 0.9, agree
    assert abs(ppl_int8 / ppl_base - 1) < 0.05, (ppl_base, ppl_int8)
    # Free-running greedy: once a near tie flips, the texts part; measured 0 + 8 + 16 of 48 tokens in a
    # common prefix (a broken kernel gives none).
    common = 0
    for a, b in zip(base_greedy, int8_greedy):
        while common < 48 and len(a) > 0 and a[:1] == b[:1]:
            a, b, common = a[1:], b[1:], common + 1
    assert common >= 16, (base_greedy, int8_greedy)


def test_float_weights_fall_back_to_the_float_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    path = save_hf_model(make_hf_model("llama", seed=4), tmp_path / "llama")
    prompts = [list(range(3, 20)), [7, 8]]
    plain = LLM(model=str(path), num_kv_blocks=32, quantization="float32")
    expected = engine_greedy(plain, prompts, 8)
    del plain
    with caplog.at_level(logging.WARNING, logger="pagedllm.model.activation_format"):
        llm = LLM(model=str(path), num_kv_blocks=32, quantization="float32", quant_activations="int8")
    assert "linears take float32 activations (no linear has a weight type of the int8 kernel" in caplog.text
    assert all(lin.quant_weight is None for lin in linears(llm))
    assert engine_greedy(llm, prompts, 8) == expected
