"""Quantized GGUF weights kept quantized through loading: every linear, the embedding and the LM
head (tied or not) run from the repacked blocks, with no float32 copy, and the model equals the
dequantized float32 path (``gguf_dequantize=True``) up to summation order; tensor-parallel shards of
a quantized weight equal the float shards; without the kernel the weights are dequantized."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedllm.model import load_model
from pagedllm.model.layers import quantized
from pagedllm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.embedding import LMHead, VocabEmbedding
from pagedllm.model.layers.quantized import QuantTensor
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.paged_kv_helpers import PagedRunner
from tests.model.tiny_models import make_hf_model

IDS = list(range(3, 40))
needs_kernel = pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    runner = PagedRunner(model, block_size=4)
    logits = runner.step([(0, prompt)])
    first, out = logits, []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = runner.step([(0, out[-1:])])
    return out, first


def linears(model):
    return [m for m in model.modules() if hasattr(m, "quant_weight") and not isinstance(m, VocabEmbedding)]


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_tiny_model_runs_quantized_and_equals_dequantized(kind, qtype, tmp_path):
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_llama_gguf(make_hf_model(kind, seed=5), path, GGMLQuantizationType[qtype])
    quant = load_model(str(path)).model
    dense = load_model(str(path), gguf_dequantize=True).model
    for layer in linears(quant) + [quant.model.embed_tokens, quant.lm_head]:
        assert layer.quant_weight is not None and layer.quant_weight.qtype == GGMLQuantizationType[qtype]
        assert layer.weight.numel() == 0  # no float32 copy
    assert all(layer.quant_weight is None for layer in linears(dense) + [dense.lm_head])
    if kind == "llama_tied":
        assert quant.lm_head.quant_weight is quant.model.embed_tokens.quant_weight
    tokens_q, logits_q = greedy(quant, IDS, 12)
    tokens_d, logits_d = greedy(dense, IDS, 12)
    torch.testing.assert_close(logits_q, logits_d, atol=1e-4, rtol=0)
    assert tokens_q == tokens_d


def test_without_the_kernel_weights_are_dequantized(tmp_path, monkeypatch):
    path = tmp_path / "tiny-Q4_1.gguf"
    write_llama_gguf(make_hf_model("llama_tied", seed=6), path, GGMLQuantizationType.Q4_1)
    monkeypatch.setattr(quantized, "kernel_available", lambda: False)
    fallback = load_model(str(path)).model
    dense = load_model(str(path), gguf_dequantize=True).model
    assert all(layer.quant_weight is None for layer in linears(fallback) + [fallback.lm_head])
    for a, b in zip(fallback.state_dict().values(), dense.state_dict().values()):
        assert torch.equal(a, b)  # the same float32 weights the conversion holds
    torch.testing.assert_close(greedy(fallback, IDS, 0)[1], greedy(dense, IDS, 0)[1], atol=0, rtol=0)


def _quant(qtype, n, k, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, qtype)
    return QuantTensor(int(qtype), torch.from_numpy(raw), k), torch.from_numpy(dequantize(raw, qtype).reshape(n, k))


@needs_kernel
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tensor_parallel_shards_of_a_quantized_weight(tp_rank):
    """Column shards take rows, row shards take whole 32-column blocks: each rank's product equals
    the float layer's built from the same shard (the all-reduce itself is tested elsewhere)."""
    qtype = GGMLQuantizationType.Q4_0
    x = torch.randn(5, 128)
    q, w = _quant(qtype, 96, 128, seed=1)
    for make in (lambda: ColumnParallelLinear(128, 96, tp_size=2, tp_rank=tp_rank),
                 lambda: RowParallelLinear(128, 96, tp_size=2, tp_rank=tp_rank)):
        layer_q, layer_f = make(), make()
        layer_q.weight.weight_loader(layer_q.weight, q)
        layer_f.weight.weight_loader(layer_f.weight, w)
        layer_q.process_weights_after_loading()
        layer_f.process_weights_after_loading()
        assert layer_q.quant_weight is not None and layer_f.quant_weight is None
        xs = x if isinstance(layer_q, ColumnParallelLinear) else x[:, tp_rank * 64 : (tp_rank + 1) * 64]
        torch.testing.assert_close(layer_q.matmul(xs, None), layer_f.matmul(xs, None), atol=1e-4, rtol=0)
    # Fused QKV: q heads split, the single KV head replicated (the float loader's offsets).
    qkv_q, qkv_f = (QKVParallelLinear(64, 32, 2, 1, tp_size=2, tp_rank=tp_rank) for _ in range(2))
    shards = {"q": _quant(qtype, 64, 64, 2), "k": _quant(qtype, 32, 64, 3), "v": _quant(qtype, 32, 64, 4)}
    for shard_id, (sq, sf) in shards.items():
        qkv_q.weight.weight_loader(qkv_q.weight, sq, shard_id)
        qkv_f.weight.weight_loader(qkv_f.weight, sf, shard_id)
    qkv_q.process_weights_after_loading()
    qkv_f.process_weights_after_loading()
    torch.testing.assert_close(qkv_q.matmul(x[:, :64], None), qkv_f.matmul(x[:, :64], None), atol=1e-4, rtol=0)
    # The vocabulary split pads the last rank with zero rows.
    table_q, table_f = _quant(GGMLQuantizationType.Q8_0, 75, 64, seed=5)
    emb_q, emb_f = (LMHead(75, 64, tp_size=2, tp_rank=tp_rank) for _ in range(2))
    emb_q.weight.weight_loader(emb_q.weight, table_q)
    emb_f.weight.weight_loader(emb_f.weight, table_f)
    emb_q.process_weights_after_loading()
    emb_f.process_weights_after_loading()
    ids = torch.arange(38)
    assert torch.equal(emb_q._lookup(ids), emb_f._lookup(ids))
    torch.testing.assert_close(emb_q.quant_weight.matmul(x[:, :64]), torch.nn.functional.linear(x[:, :64], emb_f.weight),
                               atol=1e-4, rtol=0)


def test_mixed_shard_types_fall_back_to_float():
    layer = QKVParallelLinear(64, 32, 2, 1)
    layer.weight.weight_loader(layer.weight, _quant(GGMLQuantizationType.Q4_0, 64, 64, 2)[0], "q")
    layer.weight.weight_loader(layer.weight, _quant(GGMLQuantizationType.Q8_0, 32, 64, 3)[0], "k")
    _, v = _quant(GGMLQuantizationType.Q8_0, 32, 64, 4)
    layer.weight.weight_loader(layer.weight, v, "v")  # a float shard
    layer.process_weights_after_loading()
    assert layer.quant_weight is None
    expected = torch.cat([_quant(GGMLQuantizationType.Q4_0, 64, 64, 2)[1], _quant(GGMLQuantizationType.Q8_0, 32, 64, 3)[1], v])
    assert torch.equal(layer.weight.detach(), expected)


@pytest.mark.slow  # the default model, quantized and dequantized
@needs_kernel
def test_default_model_runs_from_its_shipped_q4_1_blocks(default_model, monkeypatch):
    loaded, cache, _ = default_model
    model = loaded.model
    layers = linears(model)
    assert len(layers) == 30 * 4 and all(l.quant_weight.qtype == GGMLQuantizationType.Q4_1 for l in layers)
    assert model.lm_head.quant_weight is model.model.embed_tokens.quant_weight  # tied, Q8_0 in the file
    assert model.lm_head.quant_weight.qtype == GGMLQuantizationType.Q8_0
    float_params = sum(p.numel() for p in model.parameters())
    assert float_params < 100_000  # the norms only: no float32 copy of any weight
    packed = sum(l.quant_weight.nbytes for l in layers) + model.lm_head.quant_weight.nbytes
    assert packed < 105e6  # the GGUF file is 98 MB; float32 would be 538 MB
    monkeypatch.setenv("PAGEDLLM_CACHE", str(cache))
    dense = load_model(None, gguf_dequantize=True).model
    messages = [{"role": "user", "content": "Name three colours."}]
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens_q, logits_q = greedy(model, prompt, 24)
    tokens_d, logits_d = greedy(dense, prompt, 24)
    torch.testing.assert_close(logits_q, logits_d, atol=1e-3, rtol=0)
    assert tokens_q == tokens_d


@needs_kernel
def test_k_quant_model_runs_expanded_and_equals_dequantized(tmp_path):
    """Q4_K / Q5_K / Q6_K tensors (random blocks: the gguf package cannot quantize to them) run
    through the expanded QX panels and equal the dequantized float32 path."""
    from tests.model.test_quant_kernels import random_k_quant

    hf = make_hf_model("llama", seed=7, hidden_size=256, intermediate_size=512, head_dim=64)
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K", "ffn_gate": "Q5_K",
             "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"}
    rng = np.random.default_rng(0)
    override = {}
    for name, tensor in hf.state_dict().items():
        if tensor.dim() != 2:
            continue
        from tests.model.gguf_writer_helpers import gguf_name

        target = gguf_name(name)
        qtype = GGMLQuantizationType[types[target.split(".")[-2]]]
        override[target] = (random_k_quant(int(qtype), tensor.shape[0], tensor.shape[1], rng, scale=(1e-5, 1e-4)), qtype)
    path = tmp_path / "tiny-kquants.gguf"
    write_llama_gguf(hf, path, GGMLQuantizationType.F32, override=override)
    quant = load_model(str(path)).model
    dense = load_model(str(path), gguf_dequantize=True).model
    for layer in linears(quant) + [quant.model.embed_tokens, quant.lm_head]:
        assert layer.quant_weight is not None and layer.quant_weight.kernel_type == quantized.QX
    assert quant.model.layers[0].mlp.down_proj.quant_weight.qtype == GGMLQuantizationType.Q6_K
    tokens_q, logits_q = greedy(quant, IDS, 8)
    tokens_d, logits_d = greedy(dense, IDS, 8)
    torch.testing.assert_close(logits_q, logits_d, atol=1e-4 * float(logits_d.abs().max()), rtol=0)
    assert tokens_q == tokens_d
