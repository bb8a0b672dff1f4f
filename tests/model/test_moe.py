"""The sparse-MoE layer alone (model/layers/moe.py): the grouped path equals every expert computed
densely, and tensor-parallel slices of the experts add up to the unsharded layer; GGUF-quantized
experts stay quantized (no float copy, the GGUF's bytes) and equal their dequantized floats, sliced
or not, and are dequantized where the kernel is unavailable."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedllm.distributed.shapes import check_config_tp_size
from pagedllm.model.layers import quantized
from pagedllm.model.layers.moe import SparseMoE
from pagedllm.model.layers.quantized import QuantTensor
from tests.model.test_quant_kernels import random_k_quant
from tests.model.tiny_models import tiny_config

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 6, 2


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's HF-named tensors: the router and each expert's gate/up/down."""
    g = torch.Generator().manual_seed(seed)
    weights = {"gate": torch.randn(EXPERTS, HIDDEN, generator=g)}
    for e in range(EXPERTS):
        weights[f"{e}.gate_proj"] = torch.randn(INTER, HIDDEN, generator=g) * 0.2
        weights[f"{e}.up_proj"] = torch.randn(INTER, HIDDEN, generator=g) * 0.2
        weights[f"{e}.down_proj"] = torch.randn(HIDDEN, INTER, generator=g) * 0.2
    return weights


def _layer(weights, tp_size: int = 1, tp_rank: int = 0, packed: bool = True) -> SparseMoE:
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize=True, tp_size=tp_size, tp_rank=tp_rank)
    moe.gate.weight.data.copy_(weights["gate"])
    w13, w2 = moe.experts.w13, moe.experts.w2
    for e in range(EXPERTS):
        w13.weight_loader(w13, weights[f"{e}.gate_proj"], (e, 0))
        w13.weight_loader(w13, weights[f"{e}.up_proj"], (e, 1))
        w2.weight_loader(w2, weights[f"{e}.down_proj"], (e,))
    if packed:
        moe.experts.process_weights_after_loading()
    return moe


@torch.inference_mode()
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_grouped_equals_dense_and_the_dense_switch(num_tokens):
    moe = _layer(_checkpoint())
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    grouped = moe(x)
    torch.testing.assert_close(grouped, moe.forward_dense(x), atol=1e-5, rtol=1e-5)
    moe.dense = True  # what `bench moe` flips for its dense baseline
    torch.testing.assert_close(moe(x), grouped, atol=1e-5, rtol=1e-5)
    # Not a vacuous equality: the layer depends on which experts the router picked.
    moe.gate.weight.data.neg_()
    assert not torch.allclose(moe(x), grouped, atol=1e-3)


@torch.inference_mode()
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_slices_sum_to_the_whole_layer(tp_size):
    """Each rank holds every expert's intermediate slice; the sum of the ranks' outputs (what the
    all-reduce makes) is the unsharded output. (At world size 1 the layer's all-reduce is a no-op,
    so each rank's share can be read here without processes.)"""
    weights = _checkpoint(1)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    whole = _layer(weights)(x)
    shards = [_layer(weights, tp_size, rank) for rank in range(tp_size)]
    assert shards[0].experts.w13.shape == (EXPERTS, 2 * INTER // tp_size, HIDDEN)
    assert shards[0].experts.w2.shape == (EXPERTS, HIDDEN, INTER // tp_size)
    parts = [shard(x) for shard in shards]
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(parts[0], whole, atol=1e-3)  # one slice alone is not the answer


def test_intermediate_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="intermediate size 24 does not split tensor_parallel_size=5"):
        SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize=True, tp_size=5)
    # Qwen3-MoE: the experts' 48 splits 2 and 4 ways with the dense 128, not 32 ways.
    config = tiny_config("qwen3_moe", num_attention_heads=32, num_key_value_heads=32, head_dim=2)
    check_config_tp_size(config, 4)
    with pytest.raises(ValueError, match="valid sizes: 1, 2, 4, 8, 16$"):
        check_config_tp_size(config, 32)



# Quantized experts (a GGUF's stacked experts kept quantized, layers/quantized.py).
needs_kernel = pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")


def _quantized_checkpoint(qtype: GGMLQuantizationType, hidden: int, inter: int) -> tuple[dict, dict]:
    """(router + each expert's gate/up/down as QuantTensors, the same dequantized to float32)."""
    g, rng = torch.Generator().manual_seed(3), np.random.default_rng(3)
    quant = {"gate": torch.randn(EXPERTS, hidden, generator=g)}
    floats = dict(quant)
    for e in range(EXPERTS):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            if qtype == GGMLQuantizationType.Q4_K:  # gguf cannot quantize to it: random blocks
                raw = random_k_quant(int(qtype), *shape, rng, scale=(1e-3, 2e-3))
            else:
                raw = quantize((torch.randn(*shape, generator=g) * 0.2).numpy(), qtype)
            quant[f"{e}.{proj}"] = QuantTensor(int(qtype), torch.from_numpy(raw), shape[1])
            floats[f"{e}.{proj}"] = torch.from_numpy(dequantize(raw, qtype).reshape(shape).copy())
    return quant, floats


def _q_layer(weights, tp_size: int = 1, tp_rank: int = 0) -> SparseMoE:
    inter, hidden = weights["0.gate_proj"].shape
    moe = SparseMoE(hidden, inter, EXPERTS, TOP_K, renormalize=True, tp_size=tp_size, tp_rank=tp_rank)
    moe.gate.weight.data.copy_(weights["gate"])
    w13, w2 = moe.experts.w13, moe.experts.w2
    for e in range(EXPERTS):
        w13.weight_loader(w13, weights[f"{e}.gate_proj"], (e, 0))
        w13.weight_loader(w13, weights[f"{e}.up_proj"], (e, 1))
        w2.weight_loader(w2, weights[f"{e}.down_proj"], (e,))
    moe.experts.process_weights_after_loading()
    return moe


@needs_kernel
@torch.inference_mode()
@pytest.mark.parametrize("qtype, size", [("Q8_0", 64), ("Q4_0", 64), ("Q4_K", 256)])
def test_quantized_experts_stay_quantized_and_equal_their_floats(qtype, size):
    qtype = GGMLQuantizationType[qtype]
    quant_w, float_w = _quantized_checkpoint(qtype, size, size)
    quant, floats = _q_layer(quant_w), _q_layer(float_w)
    experts = quant.experts
    assert all(q is not None and len(q) == EXPERTS for q in experts.quant)
    assert experts.w13.numel() == 0 and experts.w2.numel() == 0  # no float32 copy
    assert floats.experts.quant == [None, None] and floats.experts.quantized_nbytes == 0
    if qtype != GGMLQuantizationType.Q4_K:  # repacked Q8_0/Q4_0: exactly the GGUF bytes (K-quants: 12 bits)
        assert experts.quantized_nbytes == sum(t.raw.numel() for name, t in quant_w.items() if name != "gate")
    for num_tokens in (1, 7, 40):
        x = torch.randn(num_tokens, size, generator=torch.Generator().manual_seed(num_tokens))
        want = floats(x)
        # Random K-quant blocks give outputs up to ~4e7 whose elements cancel: summation order (which differs
        # between the kernel's ISAs) moves them by ~2e-7 of the largest output, not of their own size.
        atol = max(1e-4, 1e-6 * want.abs().max().item())
        torch.testing.assert_close(quant(x), want, atol=atol, rtol=1e-4)
        torch.testing.assert_close(quant.forward_dense(x), want, atol=atol, rtol=1e-4)
        assert not torch.allclose(want, torch.zeros_like(want), atol=1e-2)


@needs_kernel
@torch.inference_mode()
@pytest.mark.parametrize("tp_size", [2, 4])
def test_quantized_tensor_parallel_slices_sum_to_the_whole_layer(tp_size, caplog):
    """gate/up slice by rows (always whole blocks: quantized); down by columns: 64 / 2 = 32 columns
    are whole Q8_0 blocks (quantized), 64 / 4 = 16 cut them (that shard dequantized, as a dense
    row-parallel shard is, with one warning per rank's layer, not one per expert)."""
    quant_w, float_w = _quantized_checkpoint(GGMLQuantizationType.Q8_0, 64, 64)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    whole = _q_layer(float_w)(x)
    with caplog.at_level("WARNING"):
        shards = [_q_layer(quant_w, tp_size, rank) for rank in range(tp_size)]
    assert len([r for r in caplog.records if "cut" in r.getMessage()]) == (0 if tp_size == 2 else tp_size)
    for shard in shards:
        assert shard.experts.quant[0] is not None and shard.experts.w13.numel() == 0
        assert (shard.experts.quant[1] is not None) == (tp_size == 2)
    assert shards[-1].experts.w2.shape == ((EXPERTS, 64, 0) if tp_size == 2 else (EXPERTS, 64, 64 // tp_size))
    torch.testing.assert_close(sum(shard(x) for shard in shards), whole, atol=1e-4, rtol=1e-4)


def test_quantized_experts_without_the_kernel_are_dequantized(monkeypatch):
    quant_w, float_w = _quantized_checkpoint(GGMLQuantizationType.Q8_0, 64, 64)
    monkeypatch.setattr(quantized, "kernel_available", lambda: False)
    fallback = _q_layer(quant_w)
    assert fallback.experts.quant == [None, None]
    torch.testing.assert_close(fallback.experts.w13.detach(), _q_layer(float_w).experts.w13.detach(), atol=0, rtol=0)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(fallback(x), _q_layer(float_w)(x), atol=1e-5, rtol=1e-5)


@needs_kernel
@torch.inference_mode()
def test_gate_and_up_of_different_types_are_dequantized_and_down_stays_quantized():
    q8, f8 = _quantized_checkpoint(GGMLQuantizationType.Q8_0, 64, 64)
    q4, f4 = _quantized_checkpoint(GGMLQuantizationType.Q4_0, 64, 64)
    mixed = dict(q8, **{f"{e}.up_proj": q4[f"{e}.up_proj"] for e in range(EXPERTS)})
    floats = dict(f8, **{f"{e}.up_proj": f4[f"{e}.up_proj"] for e in range(EXPERTS)})
    layer = _q_layer(mixed)
    assert layer.experts.quant[0] is None and layer.experts.w13.shape == (EXPERTS, 128, 64)
    assert layer.experts.quant[1] is not None and layer.experts.w2.numel() == 0
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(layer(x), _q_layer(floats)(x), atol=1e-4, rtol=1e-4)


@needs_kernel
def test_an_expert_is_repacked_when_its_last_shard_comes_and_its_source_let_go():
    """The loader's shards are views of the file's map: held to the end of the load, a 17 GB file's pages would
    come back into the resident set beside the repacked experts."""
    quant_w, float_w = _quantized_checkpoint(GGMLQuantizationType.Q8_0, 64, 64)
    moe = SparseMoE(64, 64, EXPERTS, TOP_K, renormalize=True)
    moe.gate.weight.data.copy_(quant_w["gate"])
    experts = moe.experts
    w13, w2 = experts.w13, experts.w2
    w13.weight_loader(w13, quant_w["0.up_proj"], (0, 1))
    assert list(experts._staged[0]) == [0] and not experts._ready[0]  # half an expert: kept
    w13.weight_loader(w13, quant_w["0.gate_proj"], (0, 0))
    assert not experts._staged[0] and list(experts._ready[0]) == [0]  # whole: repacked, the shards dropped
    w2.weight_loader(w2, quant_w["0.down_proj"], (0,))
    assert not experts._staged[1] and list(experts._ready[1]) == [0]
    with pytest.raises(ValueError, match="expert 0's down rows were loaded twice"):
        w2.weight_loader(w2, quant_w["0.down_proj"], (0,))
    for e in range(1, EXPERTS):
        w13.weight_loader(w13, quant_w[f"{e}.gate_proj"], (e, 0))
        w13.weight_loader(w13, quant_w[f"{e}.up_proj"], (e, 1))
        w2.weight_loader(w2, quant_w[f"{e}.down_proj"], (e,))
    experts.process_weights_after_loading()
    assert experts._ready == [{}, {}] and experts.w13.numel() == 0
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(moe(x), _q_layer(float_w)(x), atol=1e-4, rtol=1e-4)
