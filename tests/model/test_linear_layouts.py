"""The CPU GEMM layouts (process_weights_after_loading) compute what F.linear computes on the
checkpoint's weights: every linear kind, tensor-parallel shards at tp=2, the LM head (packed,
tied to the embedding or not) and its fallback. In one process the collectives are no-ops, so a
rank's layer returns its own part and the test does the reduction or the gather itself.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model import load_model
from pagedllm.model.layers import cpu_gemm
from pagedllm.model.layers.embedding import LMHead, VocabEmbedding
from pagedllm.model.layers.linear import (
    PACKED_ROWS,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    mkl_pack,
)
from tests.model.tiny_models import make_hf_model, save_hf_model

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 96, 4, 2, 16, 250  # odd vocab: TP padding
ROWS = [1, 7, 64, PACKED_ROWS[1] + 1]  # the packed GEMM at 7 and 64, F.linear outside its range
ATOL = 1e-5
HAS_MKL_PACK = hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


@pytest.fixture(autouse=True)
def mkl_layout(monkeypatch):
    """These tests are about the MKL packed copy, which the compiled GEMM replaces where it is on
    (tests/model/test_cpu_gemm.py covers that one)."""
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "1")


def rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_converted(weight: torch.Tensor, original: torch.Tensor) -> None:
    assert weight.shape == original.shape
    assert weight.t().is_contiguous() and not weight.is_contiguous(), "expected [in, out] storage"
    assert torch.equal(weight, original)


def assert_packed(layer) -> None:
    assert (layer.packed_weight is not None) == HAS_MKL_PACK


def check_rows(forward, reference, in_features: int = HIDDEN) -> None:
    for m in ROWS:
        x = rand(m, in_features, seed=m)
        torch.testing.assert_close(forward(x), reference(x), atol=ATOL, rtol=0)


def Ref(w, b=None):
    """F.linear on the unconverted checkpoint tensors."""
    return lambda x: F.linear(x, w, b)


@pytest.mark.parametrize("bias", [False, True])
def test_replicated_and_column_linear(bias):
    w, b = rand(48, HIDDEN, seed=1), rand(48, seed=2)
    for tp_size in (1, 2):
        shards = []
        for rank in range(tp_size):
            layer = ColumnParallelLinear(HIDDEN, 48, bias=bias, tp_size=tp_size, tp_rank=rank)
            layer.weight.weight_loader(layer.weight, w)
            if bias:
                layer.bias.weight_loader(layer.bias, b)
            original = layer.weight.detach().clone()
            layer.process_weights_after_loading()
            assert_converted(layer.weight, original)
            assert_packed(layer)
            shards.append(layer)
        check_rows(lambda x: torch.cat([s(x) for s in shards], dim=-1), Ref(w, b if bias else None))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_qkv_shards(tp_size):
    q, k, v = rand(HEADS * HEAD_DIM, HIDDEN, seed=3), rand(KV_HEADS * HEAD_DIM, HIDDEN, seed=4), rand(
        KV_HEADS * HEAD_DIM, HIDDEN, seed=5)
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp_size=tp_size, tp_rank=rank)
        for shard_id, tensor in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        layer.process_weights_after_loading()
        assert_packed(layer)
        qs, kvs = layer.q_size, layer.kv_size
        kv_rows = slice(layer.kv_head_start * HEAD_DIM, layer.kv_head_start * HEAD_DIM + kvs)
        expected = torch.cat([q[rank * qs:(rank + 1) * qs], k[kv_rows], v[kv_rows]])
        check_rows(layer, Ref(expected))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_gate_up_and_row_parallel_down(tp_size):
    # scaled like trained weights, so the outputs stay O(1) and ATOL means what it says
    gate, up = rand(INTER, HIDDEN, seed=6) / HIDDEN**0.5, rand(INTER, HIDDEN, seed=7) / HIDDEN**0.5
    down = rand(HIDDEN, INTER, seed=8) / INTER**0.5
    down_bias = rand(HIDDEN, seed=9)
    gate_ups, downs = [], []
    for rank in range(tp_size):
        gu = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp_size=tp_size, tp_rank=rank)
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        dn = RowParallelLinear(INTER, HIDDEN, bias=True, tp_size=tp_size, tp_rank=rank)
        dn.weight.weight_loader(dn.weight, down)
        dn.bias.weight_loader(dn.bias, down_bias)
        for layer in (gu, dn):
            original = layer.weight.detach().clone()
            layer.process_weights_after_loading()
            assert_converted(layer.weight, original)
            assert_packed(layer)
        gate_ups.append(gu)
        downs.append(dn)

    def mlp(x):
        # rank r holds gate and up rows [r*I/tp, (r+1)*I/tp) and down's matching columns;
        # the all-reduce (a no-op here) sums the partial products, each of which added the bias
        parts = []
        for gu, dn in zip(gate_ups, downs):
            g, u = gu(x).chunk(2, dim=-1)
            parts.append(dn(F.silu(g) * u))
        return sum(parts) - (tp_size - 1) * down_bias

    check_rows(mlp, lambda x: F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down, down_bias))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_lm_head_and_embedding(tied, tp_size):
    table, head = rand(VOCAB, HIDDEN, seed=10), rand(VOCAB, HIDDEN, seed=11)
    ids = torch.tensor([0, 5, 124, 125, 249])
    logits, embedded = [], torch.zeros(len(ids), HIDDEN)
    for rank in range(tp_size):
        embed = VocabEmbedding(VOCAB, HIDDEN, tp_size, rank)
        embed.weight.weight_loader(embed.weight, table)
        lm_head = LMHead(VOCAB, HIDDEN, tp_size, rank)
        if tied:
            lm_head.weight = embed.weight
        else:
            lm_head.weight.weight_loader(lm_head.weight, head)
        embed.process_weights_after_loading()
        lm_head.process_weights_after_loading()
        assert embed.weight.is_contiguous(), "the lookup table keeps its rows"
        assert (lm_head.packed_weight is not None) == HAS_MKL_PACK
        if tied:
            assert lm_head.weight is embed.weight
        embedded += embed(ids)  # the all-reduce, done here
        x = rand(64, HIDDEN, seed=12)
        logits.append(lm_head.compute_logits(x)[:, : lm_head.num_embeddings_per_partition])
    torch.testing.assert_close(embedded, F.embedding(ids, table))
    weight = table if tied else head
    for m in ROWS:
        x = rand(64, HIDDEN, seed=12)[:m]
        full = torch.cat([part[:m] for part in logits], dim=-1)[:, :VOCAB]
        torch.testing.assert_close(full, F.linear(x, weight), atol=ATOL, rtol=0)


@pytest.mark.parametrize("rows", ROWS)
def test_lm_head_packed_any_row_count(rows):
    """One packed copy serves every batch size (the op is told each call's row count)."""
    lm_head = LMHead(VOCAB, HIDDEN)
    lm_head.weight.weight_loader(lm_head.weight, rand(VOCAB, HIDDEN, seed=13))
    lm_head.process_weights_after_loading()
    x = rand(rows, HIDDEN, seed=rows)
    torch.testing.assert_close(lm_head.compute_logits(x), F.linear(x, lm_head.weight), atol=ATOL, rtol=0)


def test_lm_head_falls_back_without_the_mkl_op(monkeypatch):
    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", None, raising=False)
    lm_head = LMHead(VOCAB, HIDDEN)
    lm_head.weight.weight_loader(lm_head.weight, rand(VOCAB, HIDDEN, seed=14))
    lm_head.process_weights_after_loading()
    assert lm_head.packed_weight is None
    x = rand(7, HIDDEN, seed=15)
    torch.testing.assert_close(lm_head.compute_logits(x), F.linear(x, lm_head.weight), atol=ATOL, rtol=0)


def test_linears_fall_back_without_the_mkl_op(monkeypatch):
    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", None, raising=False)
    w, b = rand(48, HIDDEN, seed=17), rand(48, seed=18)
    layer = ColumnParallelLinear(HIDDEN, 48, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None
    check_rows(layer, Ref(w, b))


def test_only_float32_cpu_weights_change():
    layer = ColumnParallelLinear(HIDDEN, 48)
    layer.weight.data = rand(48, HIDDEN, seed=16).to(torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.weight.is_contiguous()
    assert mkl_pack(layer.weight) is None


@pytest.mark.parametrize("kind", ["llama", "llama_tied_scaled"])
def test_loaded_model_is_converted(kind, tmp_path):
    loaded = load_model(save_hf_model(make_hf_model(kind), tmp_path))
    model = loaded.model
    linears = [m for m in model.modules() if hasattr(m, "weight") and hasattr(m, "input_size")]
    assert len(linears) == 4 * model.num_layers
    assert all(m.weight.t().is_contiguous() for m in linears)
    assert all((m.packed_weight is not None) == HAS_MKL_PACK for m in linears)
    assert model.model.embed_tokens.weight.is_contiguous()
    assert (model.lm_head.packed_weight is not None) == HAS_MKL_PACK
    if kind == "llama_tied_scaled":
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.skipif(not HAS_MKL_PACK, reason="no MKL packed GEMM in this torch build")
def test_packed_copy_serves_exactly_its_row_range():
    """Row counts in PACKED_ROWS read the packed copy, others the weight: give the packed copy
    another matrix's values and see which one each call used."""
    w, other = rand(48, HIDDEN, seed=19), rand(48, HIDDEN, seed=20)
    layer = ColumnParallelLinear(HIDDEN, 48)
    layer.weight.weight_loader(layer.weight, w)
    layer.process_weights_after_loading()
    layer.packed_weight = mkl_pack(other)
    low, high = PACKED_ROWS
    for m, expected in [(low - 1, w), (low, other), (high, other), (high + 1, w)]:
        x = rand(m, HIDDEN, seed=21)
        torch.testing.assert_close(layer(x), F.linear(x, expected), atol=ATOL, rtol=0)
