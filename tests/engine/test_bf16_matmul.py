"""dtype 'bf16-matmul' (pooling models: the linears' operands rounded to bf16, float32 sums and everything
else float32) against sentence-transformers in float32, on mixed-length batches.

On a CPU without AMX-BF16 the mode runs its emulated path (a float32 matmul of the bf16-rounded operands), so the
parity tests run everywhere; the compiled op's own tests are skipped there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM
from pagedllm.bench.embed_models import build_cross_encoder, build_embedder, mixed_lengths, texts_of_lengths, SHAPES
from pagedllm.model.layers import bf16_matmul
from pagedllm.model.layers.bf16_matmul import Bf16Matmul

needs_amx = pytest.mark.skipif(not bf16_matmul.compiled_available(),
                               reason="the compiled bf16 matmul needs AMX-BF16 (and the built library)")


def _min_cosine(ours, reference) -> float:
    ours, reference = np.asarray(ours, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return float(((ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)).min())


def _bf16_reference(x, w, bias=None):
    y = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()
    return y if bias is None else y + bias.double()


@needs_amx
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (37, 64, 100), (300, 384, 1536), (513, 128, 72), (65, 34, 64),
                                   (1100, 96, 200)])
def test_compiled_op_sums_bf16_operands_in_float32(m, k, n):
    torch.manual_seed(0)
    x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    matmul = Bf16Matmul(w, compiled=True)
    assert matmul.packed is not None
    y = matmul(x, bias)
    reference = _bf16_reference(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # float32 sums of exact bf16 products: far closer than a bf16 output (2^-9 relative) would be
    assert (y.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    emulated = Bf16Matmul(w, compiled=False)(x, bias)
    assert (y - emulated).abs().max() <= 1e-5 * reference.abs().max()
    wide = torch.cat([x, torch.randn(m, 3)], dim=1)  # strided rows (a slice of a fused q/k/v output)
    assert torch.equal(matmul(wide[:, :k], bias), y)
    threads = torch.get_num_threads()
    try:  # the split of rows and column blocks over the threads changes no bit
        for count in (1, 3, 5):
            torch.set_num_threads(count)
            assert torch.equal(matmul(x, bias), y), count
    finally:
        torch.set_num_threads(threads)
    gelu = matmul(x, bias, gelu=True)  # applied on each output tile, the ragged last ones included
    exact = torch.nn.functional.gelu(y.double())
    assert (gelu.double() - exact).abs().max() <= 1e-6 * max(1.0, exact.abs().max().item())
    assert (gelu.double() - exact).abs().max() <= (torch.nn.functional.gelu(y).double() - exact).abs().max() * 2
    emulated_gelu = Bf16Matmul(w, compiled=False)(x, bias, gelu=True)
    assert torch.allclose(gelu, emulated_gelu, rtol=1e-5, atol=1e-5)


@needs_amx
def test_the_op_refuses_an_unknown_activation():
    packed = torch.ops.pagedllm.bf16_matmul_pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="activation must be"):
        torch.ops.pagedllm.bf16_matmul_cpu(torch.randn(2, 32), packed, None, 64, 7)


@needs_amx
def test_kept_outputs_are_never_written_while_held():
    # the op writes into buffers kept between calls: a held result (the next layer's input) or a view of it
    # must keep its buffer out of reuse, through more calls than there are kept buffers
    torch.manual_seed(0)
    x, w = torch.randn(96, 64), torch.randn(128, 64)
    matmul = Bf16Matmul(w, compiled=True)
    first = matmul(x, None)
    first_copy = first.clone()
    tail_view = matmul(x, None)[1:]  # the result itself dropped, a view of it held
    tail_copy = tail_view.clone()
    held = [matmul(torch.randn(96, 64), None) for _ in range(10)]
    held_copies = [y.clone() for y in held]
    for _ in range(10):
        matmul(torch.randn(96, 64), None)
    assert torch.equal(first, first_copy) and torch.equal(tail_view, tail_copy)
    assert all(torch.equal(y, c) for y, c in zip(held, held_copies))
    assert len({y.data_ptr() for y in held} | {first.data_ptr()}) == len(held) + 1


@needs_amx
def test_a_dropped_output_buffer_is_reused():
    torch.manual_seed(0)
    x, w = torch.randn(200, 64), torch.randn(96, 64)
    matmul = Bf16Matmul(w, compiled=True)
    pointer = matmul(x, None).data_ptr()
    again = matmul(x, None)  # the first result was dropped: its pages serve the next call
    assert again.data_ptr() == pointer
    assert torch.equal(matmul(x[:50], None), again[:50])  # a smaller product in a larger kept buffer


def test_emulated_path_and_odd_k():
    torch.manual_seed(0)
    x, w = torch.randn(5, 33), torch.randn(20, 33)
    matmul = Bf16Matmul(w, compiled=bf16_matmul.compiled_available())
    assert matmul.packed is None  # no VNNI pairs for an odd K: the emulated path
    assert torch.allclose(matmul(x, None).double(), _bf16_reference(x, w), rtol=0, atol=1e-5)


@needs_amx
def test_compiled_op_refuses_bad_input():
    packed = torch.ops.pagedllm.bf16_matmul_pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="x has 16 columns"):
        torch.ops.pagedllm.bf16_matmul_cpu(torch.randn(2, 16), packed, None, 64)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedllm.bf16_matmul_cpu(torch.randn(2, 32).double(), packed, None, 64)


def test_choice_of_the_mode(monkeypatch):
    cpu = torch.device("cpu")
    assert bf16_matmul.choose("float32", "pooling", cpu) == (False, "")
    assert not bf16_matmul.choose("auto", "generate", cpu)[0]
    assert not bf16_matmul.choose("auto", "both", cpu)[0]
    with pytest.raises(ValueError, match="runner 'pooling' only"):
        bf16_matmul.choose("bf16-matmul", "generate", cpu)
    monkeypatch.setattr(bf16_matmul, "cpu_has_fast_bf16", lambda: False)
    on, why = bf16_matmul.choose("auto", "pooling", cpu)
    assert not on and "no AMX-BF16" in why
    assert bf16_matmul.choose("bf16-matmul", "pooling", cpu)[0]
    monkeypatch.setattr(bf16_matmul, "cpu_has_fast_bf16", lambda: True)
    on, why = bf16_matmul.choose("auto", "pooling", cpu)
    assert on and "bf16-matmul" in why
    on, why = bf16_matmul.choose("auto", "pooling", cpu, scores=True)
    assert not on and "cross-encoder" in why
    assert bf16_matmul.choose("bf16-matmul", "pooling", cpu, scores=True)[0]


def test_engine_args_refuse_the_mode_outside_pooling():
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="runner 'pooling'"):
        EngineArgs(model=None, dtype="bf16-matmul").model_config()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-matmul")
    return {"minilm": build_embedder("minilm", root), "qwen3-tiny": build_embedder("qwen3-tiny", root),
            "cross": build_cross_encoder("minilm", root)}


@pytest.mark.parametrize("shape", ["minilm", "qwen3-tiny"])
def test_vectors_within_cosine_of_sentence_transformers(models, shape):
    from sentence_transformers import SentenceTransformer

    texts = texts_of_lengths(SHAPES[shape], mixed_lengths(48, 8, 256, 1), 2)
    reference = SentenceTransformer(str(models[shape]), device="cpu").encode(texts, convert_to_numpy=True)
    mixed = LLM(str(models[shape]), runner="pooling", dtype="bf16-matmul", max_num_batched_tokens=2048).embed(texts)
    exact = LLM(str(models[shape]), runner="pooling", dtype="float32", max_num_batched_tokens=2048).embed(texts)
    assert _min_cosine(mixed, reference) >= 0.9999
    assert np.abs(np.asarray(exact) - reference).max() < 1e-4  # float32 stays the exact path
    assert np.abs(np.asarray(mixed) - np.asarray(exact)).max() > 1e-6  # the mode did round something


def test_rerank_scores_float32_by_default_and_near_in_the_mode(models):
    from sentence_transformers.cross_encoder import CrossEncoder

    shape = SHAPES["minilm"]
    queries = texts_of_lengths(shape, mixed_lengths(32, 8, 32, 3), 3)
    documents = texts_of_lengths(shape, mixed_lengths(32, 8, 256, 4), 4)
    reference = CrossEncoder(str(models["cross"]), device="cpu").predict(list(zip(queries, documents)))
    default = LLM(str(models["cross"]), runner="pooling").score(queries, documents)
    assert np.abs(np.asarray(default) - reference).max() < 1e-4  # auto keeps a cross-encoder float32
    mixed = LLM(str(models["cross"]), runner="pooling", dtype="bf16-matmul").score(queries, documents)
    # the mode misses the 1e-4 bar here (measured 3.7e-4), which is why auto does not pick it for scores
    assert 1e-6 < np.abs(np.asarray(mixed) - reference).max() < 2e-3


def test_auto_is_the_mode_for_an_embedder_only_where_amx_is(models):
    from pagedllm.model.layers.greedy_head import cpu_has_fast_bf16

    texts = texts_of_lengths(SHAPES["minilm"], mixed_lengths(12, 8, 128, 5), 5)
    vectors = {dtype: np.asarray(LLM(str(models["minilm"]), runner="pooling", dtype=dtype).embed(texts))
               for dtype in ("auto", "bf16-matmul", "float32")}
    expected = "bf16-matmul" if cpu_has_fast_bf16() else "float32"
    assert np.array_equal(vectors["auto"], vectors[expected])
    assert not np.array_equal(vectors["bf16-matmul"], vectors["float32"])
