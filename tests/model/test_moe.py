"""The sparse-MoE layer alone (model/layers/moe.py): the grouped path equals every expert computed
densely, and tensor-parallel slices of the experts add up to the unsharded layer."""

import pytest
import torch

from pagedllm.distributed.shapes import check_config_tp_size
from pagedllm.model.layers.moe import SparseMoE
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
