"""One greedy path (model/sampling/sampler.py `greedy_tokens`): each row's argmax of the logits, from the greedy head where it
applies, else from the float32 logits with the reason it fell back."""

import pytest
import torch
from transformers import LlamaConfig

from pagedllm.model.layers import greedy_head
from pagedllm.model.layers.greedy_head import GreedyFallback, GreedyHead
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.sampling.sampler import greedy_tokens


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def _argmax_of_logits(model, hidden):
    return model.compute_logits(hidden).argmax(dim=-1)


def test_without_a_greedy_head_the_logits_give_the_tokens_and_say_why():
    model = _model()  # the head is built with the weights' layouts (process_weights_after_loading): none yet
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    got = greedy_tokens(model, hidden)
    assert got.fallback is GreedyFallback.NO_GREEDY_HEAD
    assert torch.equal(got.token_ids, _argmax_of_logits(model, hidden))


def test_soft_capped_logits_fall_back_and_say_why():
    model = _model()
    model.final_softcap = 0.5  # the head's ids would be the uncapped argmax: never taken under a cap
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)) * 4
    got = greedy_tokens(model, hidden)
    assert got.fallback is GreedyFallback.FINAL_SOFTCAP
    assert torch.equal(got.token_ids, _argmax_of_logits(model, hidden))


@pytest.mark.skipif(not greedy_head._select_available(), reason="compiled greedy_select_cpu unavailable")
def test_the_greedy_head_gives_the_tokens_where_it_applies_and_few_rows_fall_back():
    model = _model()
    model.lm_head.greedy_head = GreedyHead.build(model.lm_head.weight, force=True)
    hidden = torch.randn(greedy_head.MIN_ROWS + 2, 64, generator=torch.Generator().manual_seed(3))
    got = greedy_tokens(model, hidden)
    assert got.fallback is None and torch.equal(got.token_ids, _argmax_of_logits(model, hidden))
    few = greedy_tokens(model, hidden[: greedy_head.MIN_ROWS - 1])
    assert few.fallback is GreedyFallback.FEW_ROWS
    assert torch.equal(few.token_ids, _argmax_of_logits(model, hidden[: greedy_head.MIN_ROWS - 1]))
