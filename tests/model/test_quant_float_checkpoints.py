"""Unquantized safetensors checkpoints kept small (``--quantization``, ``layers/quantized.py``):

* bf16 checkpoints keep their linear, embedding and head weights bf16 (the compiled kernel of
  csrc/bf16_gemm*.cpp widens them in registers and accumulates in float32), so the engine equals
  Hugging Face run in float32 on the same bf16 weights, greedy token for token with logprobs
  within 1e-3; a differing token is tolerated only as tests/hf_reference.py's near-tie rule says
  (both in HF's top 5, HF logprobs within 1e-4), at most one prompt a run;
* ``int8`` quantizes float weights to Q8_0 at load: logits close to the float32 path, greedy equal
  to HF on the dequantized twin (quantize -> dequantize the same weights, loaded into HF);
* without the kernel a bf16 checkpoint is widened to float32 with a log line; unknown values are refused.
"""

import copy
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedllm import LLM
from pagedllm.config.engine_args import EngineArgs
from pagedllm.model import load_model
from pagedllm.model.layers import quantized
from pagedllm.model.layers.embedding import VocabEmbedding
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.tiny_models import make_hf_model, save_hf_model

PROMPTS = [list(range(3, 40)), [7], list(range(100, 117))]
MAX_NEW_TOKENS = 10
needs_kernel = pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def weights(model):
    """Every layer ``finalize`` converts: the linears, the embedding and the LM head."""
    return [m for m in model.modules() if hasattr(m, "quant_weight") and hasattr(m, "weight")]


def bf16_checkpoint(tmp_path, kind="llama", seed=3):
    """(path of a bf16 safetensors checkpoint, HF float32 model on the same bf16-rounded weights)."""
    hf = make_hf_model(kind, seed=seed)
    path = save_hf_model(copy.deepcopy(hf).to(torch.bfloat16), tmp_path / f"{kind}-bf16")
    return path, rounded_to_bf16(hf)


def rounded_to_bf16(hf, matrices_only=False):
    """``hf`` with its parameters (or only its matrices) rounded to bf16, still float32 (not
    ``.to(bfloat16).float()``, which would round the rotary ``inv_freq`` buffer as well)."""
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2 or not matrices_only:
                param.copy_(param.to(torch.bfloat16).float())
    return hf


def check_against_hf(llm, hf, label):
    hf.generation_config.eos_token_id = None
    results = engine_greedy(llm, PROMPTS, MAX_NEW_TOKENS)
    verdicts = [assert_matches_reference(ids, logprobs, hf_greedy(hf, p, MAX_NEW_TOKENS), f"{label}, {len(p)} tokens")
                for p, (ids, logprobs) in zip(PROMPTS, results)]
    assert verdicts.count("exact") >= len(verdicts) - 1, verdicts


@needs_kernel
@pytest.mark.parametrize("isa", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 13, 64])
def test_bf16_kernel_against_float64(isa, m):
    """Ragged shapes (N not a multiple of 16, several row blocks), with and without bias, each ISA."""
    if int(torch.ops.pagedllm.quant_gemm_isa(isa)) != isa:
        pytest.skip("this CPU lacks that ISA")
    torch.manual_seed(m)
    for n, k in ((37, 64), (100, 96), (16, 32)):
        w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
        raw = w.to(torch.bfloat16).view(torch.uint8)
        packed = quantized.repack(quantized.BF16, raw)
        ref = x.double() @ w.to(torch.bfloat16).double().T
        for b in (None, bias):
            y = torch.ops.pagedllm.quant_gemm_cpu(x, packed, quantized.BF16_KERNEL, n, b, isa)
            expected = ref + (0 if b is None else b.double())
            torch.testing.assert_close(y.double(), expected, atol=1e-5 * k, rtol=1e-5)
        ids = torch.tensor([0, n - 1, n // 2, 5])
        assert torch.equal(quantized.dequantize_rows(quantized.BF16_KERNEL, packed, ids), w.to(torch.bfloat16)[ids].float())


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_bf16_checkpoint_stays_bf16_and_equals_hf_float32(kind, tmp_path, caplog):
    path, hf = bf16_checkpoint(tmp_path, kind)
    with caplog.at_level(logging.INFO, logger="pagedllm.model.layers.quantized"):
        llm = LLM(model=path)
    assert "weights kept in bf16" in caplog.text
    model = llm.engine.core.executor.runner.model
    for layer in weights(model):
        assert layer.quant_weight is not None and layer.quant_weight.kernel_type == quantized.BF16_KERNEL
        assert layer.weight.numel() == 0  # no float32 copy
    if kind == "llama_tied":  # (head_dim 32: the compiled layer loop covers it, bf16 linears included)
        from pagedllm.model.layers import fused_decoder

        assert model.lm_head.quant_weight is model.model.embed_tokens.quant_weight
        assert isinstance(fused_decoder._refusal(model.model), tuple), fused_decoder._refusal(model.model)
    check_against_hf(llm, hf, f"bf16 {kind}")
    wide = load_model(path, quantization="float32").model  # widened: today's float32 path
    assert all(layer.quant_weight is None for layer in weights(wide))
    bf16_bytes = sum(layer.quant_weight.nbytes for layer in weights(model) if layer is not model.lm_head
                     or kind != "llama_tied")
    f32_bytes = sum(p.numel() * 4 for p in wide.parameters() if p.dim() == 2)
    assert bf16_bytes == f32_bytes // 2  # every shape here fills its 16-row panels


@needs_kernel
def test_int8_close_to_float32_and_equals_hf_on_the_dequantized_twin(tmp_path):
    hf = make_hf_model("llama", seed=4)
    path = save_hf_model(hf, tmp_path / "llama-f32")
    with pytest.raises(ValueError, match="auto, int8, bf16, float32"):
        EngineArgs(model=path, quantization="fp8")
    with pytest.raises(ValueError, match="auto, int8, bf16, float32"):
        load_model(path, quantization="int4")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(model=path, quantization="int8", tensor_parallel_size=2)
    assert all(layer.quant_weight is None for layer in weights(load_model(path).model))  # float32 stays float32
    llm = LLM(model=path, quantization="int8")
    model = llm.engine.core.executor.runner.model
    for layer in weights(model):
        assert layer.quant_weight.qtype == GGMLQuantizationType.Q8_0 and layer.weight.numel() == 0
    with torch.no_grad():  # the twin: what the Q8_0 blocks hold, in float32
        for param in hf.parameters():
            if param.dim() == 2:
                raw = quantize(param.numpy(), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType.Q8_0))))
    twin = load_model(save_hf_model(hf, tmp_path / "llama-twin")).model
    dense, rounded = load_model(path).model, load_model(path, quantization="bf16").model
    from tests.model.test_quant_model import greedy

    logits_q, logits_t, logits_f, logits_b = (greedy(m, PROMPTS[0], 0)[1] for m in (model, twin, dense, rounded))
    torch.testing.assert_close(logits_q, logits_t, atol=1e-4 * float(logits_t.abs().max()), rtol=0)
    # These tiny models (weights of std 0.2, tests/model/tiny_models.py) amplify any rounding: bf16's
    # 8-bit mantissa moved the logits by 0.26 of a largest 6.4 when this was written, Q8_0 by 0.54.
    err_q, err_b = float((logits_q - logits_f).abs().max()), float((logits_b - logits_f).abs().max())
    assert 0 < err_q < 4 * err_b, (err_q, err_b)
    check_against_hf(llm, hf, "int8")


@needs_kernel
def test_bf16_of_a_float32_checkpoint_rounds_its_weights(tmp_path):
    hf = make_hf_model("llama", seed=8)
    path = save_hf_model(hf, tmp_path / "llama-f32")
    llm = LLM(model=path, quantization="bf16")
    assert all(layer.quant_weight.kernel_type == quantized.BF16_KERNEL
               for layer in weights(llm.engine.core.executor.runner.model))
    check_against_hf(llm, rounded_to_bf16(hf, matrices_only=True), "bf16 rounded")  # norms stay float32


def test_without_the_kernel_a_bf16_checkpoint_is_widened(tmp_path, monkeypatch, caplog):
    path, hf = bf16_checkpoint(tmp_path, "llama_tied", seed=9)
    monkeypatch.setattr(quantized, "kernel_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="pagedllm.model.layers.quantized"):
        model = load_model(path).model
    assert "bf16 checkpoint: weights widened to float32 at load" in caplog.text
    assert all(layer.quant_weight is None for layer in weights(model))
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert not any(isinstance(layer, VocabEmbedding) and layer.weight.numel() == 0 for layer in weights(model))


@needs_kernel
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tensor_parallel_shards_convert_like_whole_weights(tp_rank):
    """A rank's shard of a bf16 checkpoint (rows, or whole 32-wide column blocks) converts to bf16
    panels whose product equals the float layer's on the same shard."""
    from pagedllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear

    w = torch.randn(96, 128).to(torch.bfloat16).float()
    x = torch.randn(5, 128)
    for make in (lambda: ColumnParallelLinear(128, 96, tp_size=2, tp_rank=tp_rank),
                 lambda: RowParallelLinear(128, 96, tp_size=2, tp_rank=tp_rank)):
        layer_b, layer_f = make(), make()
        for layer in (layer_b, layer_f):
            layer.weight.weight_loader(layer.weight, w)
        quantized.mark(layer_b.weight, quantized.BF16, True)
        layer_b.process_weights_after_loading()
        layer_f.process_weights_after_loading()
        assert layer_b.quant_weight.kernel_type == quantized.BF16_KERNEL and layer_f.quant_weight is None
        xs = x if isinstance(layer_b, ColumnParallelLinear) else x[:, tp_rank * 64 : (tp_rank + 1) * 64]
        torch.testing.assert_close(layer_b.matmul(xs, None), layer_f.matmul(xs, None), atol=1e-4, rtol=0)


def test_lossless_only_keeps_a_float32_weight_float32():
    from pagedllm.model.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(64, 32)
    layer.weight.weight_loader(layer.weight, torch.randn(32, 64))  # not bf16 values
    quantized.mark(layer.weight, quantized.BF16, True)
    layer.process_weights_after_loading()
    assert layer.quant_weight is None and layer.weight.shape == (32, 64)
