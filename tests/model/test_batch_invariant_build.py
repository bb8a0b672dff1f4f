"""The batch-invariant mode is a choice made when the model is built (model/batch_invariant.building): each layer
takes it in its constructor, and what runs the model must agree with it."""

import pytest
from transformers import LlamaConfig

from pagedllm.model import batch_invariant
from pagedllm.model.attention.backend import TORCH_BACKEND
from pagedllm.model.attention.layer import Attention, set_attention_backend
from pagedllm.model.layers.embedding import LMHead
from pagedllm.model.layers.linear import LinearBase
from pagedllm.model.llama import LlamaForCausalLM


def _config(head_dim: int = 32) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=2 * head_dim, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


@pytest.mark.parametrize("enabled", [False, True])
def test_every_layer_takes_the_choice_of_its_build(enabled):
    with batch_invariant.building(enabled):
        model = LlamaForCausalLM(_config())
    chosen = [m.batch_invariant for m in model.modules() if isinstance(m, (LinearBase, LMHead, Attention))]
    assert len(chosen) == 2 * 5 + 1 and set(chosen) == {enabled}  # per layer: qkv, o, gate_up, down, attention
    assert batch_invariant.built_for(model) is enabled
    assert batch_invariant.chosen() is False  # the block is over


def test_a_model_built_in_the_mode_refuses_a_backend_outside_it():
    with batch_invariant.building(True):
        model = LlamaForCausalLM(_config())
    with pytest.raises(ValueError, match="built in the batch-invariant mode"):
        set_attention_backend(model, TORCH_BACKEND)
    set_attention_backend(LlamaForCausalLM(_config()), TORCH_BACKEND)  # built outside: any backend
