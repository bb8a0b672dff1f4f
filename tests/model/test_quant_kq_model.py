"""A tiny Llama written as a Q4_K / Q5_K / Q6_K GGUF, loaded with int8 activations: every linear, the
embedding and the LM head held in the K-quant kernel's file-size layout (never the 12-bit expansion),
logits close to the float-activation path on the same weights, text generated through ``LLM``; and
the fallbacks (no compiled op; no int8 kernel) still load and run."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagedllm import LLM, SamplingParams
from pagedllm.model import load_model
from pagedllm.model.attention import cpu_op
from pagedllm.model.layers import kquant, quantized
from tests.model.gguf_writer_helpers import gguf_name, write_llama_gguf
from tests.model.test_quant_kernels import random_k_quant
from tests.model.test_quant_model import IDS, greedy, linears
from tests.model.tiny_models import make_hf_model

needs_kernel = pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable")
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K", "ffn_gate": "Q5_K",
         "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"}


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def kquant_gguf(tmp_path):
    """The file's path and its raw token embedding (random blocks: gguf cannot quantize to K-quants)."""
    hf = make_hf_model("llama", seed=7, hidden_size=256, intermediate_size=512, head_dim=64)
    rng = np.random.default_rng(0)
    override = {}
    for name, tensor in hf.state_dict().items():
        if tensor.dim() == 2:
            target = gguf_name(name)
            qtype = GGMLQuantizationType[TYPES[target.split(".")[-2]]]
            raw = random_k_quant(int(qtype), tensor.shape[0], tensor.shape[1], rng, scale=(1e-5, 1e-4))
            override[target] = (raw, qtype)
    path = tmp_path / "tiny-kquants.gguf"
    write_llama_gguf(hf, path, GGMLQuantizationType.F32, override=override)
    return path, override["token_embd.weight"][0]


FLOAT_MATMUL = quantized.QuantizedWeight.matmul


def fake_quantized_matmul(self, x, bias=None):
    """The float-activation kernel on x rounded as the int8 kernel rounds it (quantize_activations)."""
    rows = x.reshape(-1, self.k).float().contiguous()
    q, d, _ = quantized.quantize_activations(rows)
    rounded = (q.float().view(rows.shape[0], -1, 32) * d.unsqueeze(-1)).reshape(x.shape)
    return FLOAT_MATMUL(self, rounded, bias)


@needs_kernel
def test_k_quant_model_with_int8_activations(kquant_gguf, monkeypatch):
    path, embed_raw = kquant_gguf
    model = load_model(str(path), quant_activations="int8").model
    held = linears(model) + [model.model.embed_tokens, model.lm_head]
    for layer in held:
        weight = layer.quant_weight
        assert weight.kernel_type == kquant.KERNEL_TYPE[weight.qtype], (layer, weight.kernel_type)
    file_bytes = sum(int(np.prod(t.shape)) for t in [embed_raw])  # the embedding: held at the file's size
    assert model.model.embed_tokens.quant_weight.nbytes <= 1.05 * file_bytes
    expected = dequantize(embed_raw, GGMLQuantizationType.Q4_K).reshape(model.model.embed_tokens.weight.shape[0], -1)
    ids = torch.tensor([0, 5, 31, 5])
    assert torch.equal(model.model.embed_tokens(ids), torch.from_numpy(expected[ids.numpy()]))

    float_path = load_model(str(path)).model  # --quant-activations none: the QX panels, float activations
    assert {layer.quant_weight.kernel_type for layer in linears(float_path)} == {quantized.QX}
    tokens_q, logits_q = greedy(model, IDS, 6)
    tokens_f, logits_f = greedy(float_path, IDS, 6)
    # int8 activations round each 32-block to 1/254 of its largest value: measured here, the mean |difference|
    # 1.5% of the mean |logit| (a random model's hidden states have large outlier channels); a kernel reading
    # a wrong byte or scale is off by the logits' own size
    diff = (logits_q - logits_f).abs()
    assert 0 < float(diff.mean()) < 0.03 * float(logits_f.abs().mean())
    assert tokens_q == tokens_f
    # The same float path fed the activations as the int8 kernel rounds them: equal up to float32 sums
    # (measured: 1e-3 of logits up to 127)
    with monkeypatch.context() as patch:
        patch.setattr(quantized.QuantizedWeight, "matmul", fake_quantized_matmul)
        _, logits_fq = greedy(float_path, IDS, 6)
    torch.testing.assert_close(logits_q, logits_fq, atol=2e-5 * float(logits_fq.abs().max()), rtol=0)

    llm = LLM(model=str(path), quant_activations="int8", num_kv_blocks=64, enable_prefix_caching=False)
    runner_model = llm.engine.core.executor.runner.model
    assert runner_model.model.layers[0].mlp.down_proj.quant_weight.kernel_type == kquant.KERNEL_TYPE[quantized.Q6_K]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == tokens_q  # the engine (fused decoder) as the model steps


@needs_kernel
def test_without_the_int8_kernel_k_quants_keep_the_float_path(kquant_gguf, monkeypatch):
    path, _ = kquant_gguf
    expected, _ = greedy(load_model(str(path)).model, IDS, 4)
    monkeypatch.setattr(quantized, "int8_kernel_available", lambda: False)
    model = load_model(str(path), quant_activations="auto").model  # the default falls back quietly
    assert {layer.quant_weight.kernel_type for layer in linears(model)} == {quantized.QX}
    assert greedy(model, IDS, 4)[0] == expected
    with pytest.raises(ValueError, match="int8-activation kernel does not run here"):  # asked for by name: refused
        load_model(str(path), quant_activations="int8")


def test_without_the_compiled_op_k_quants_load_dequantized(kquant_gguf, monkeypatch):
    path, _ = kquant_gguf
    monkeypatch.setenv(cpu_op.DISABLE_ENV, "1")
    monkeypatch.setattr(cpu_op, "_state", {})
    model = load_model(str(path), quant_activations="auto").model
    assert all(layer.quant_weight is None for layer in linears(model))
    dense = load_model(str(path), gguf_dequantize=True).model
    assert greedy(model, IDS, 4)[0] == greedy(dense, IDS, 4)[0]
