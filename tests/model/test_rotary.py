"""Rotary cos/sin against transformers' LlamaRotaryEmbedding for each supported rope type."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagedllm.model.layers.rotary import RotaryEmbedding

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotary_matches_hf(rope):
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_parameters=ROPES[rope]
    )
    ours = RotaryEmbedding(config, head_dim=16)
    hf = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 31, 32, 77, 127])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(ours.cos_cache[positions], cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin_cache[positions], sin[0], atol=1e-6, rtol=0)


def test_apply_rotary_is_rotate_half():
    config = LlamaConfig(hidden_size=16, num_attention_heads=2, max_position_embeddings=8)
    rot = RotaryEmbedding(config, head_dim=8)
    q = torch.randn(3, 2, 8)
    k = torch.randn(3, 1, 8)
    q2, k2 = rot(torch.tensor([0, 3, 7]), q, k)
    torch.testing.assert_close(q2[0], q[0])  # position 0 is the identity
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps norms
    torch.testing.assert_close(k2.norm(dim=-1), k.norm(dim=-1))


def test_queries_and_keys_rotated_together_equal_separate_passes():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    rot = RotaryEmbedding(config, head_dim=8)
    positions = torch.tensor([0, 5, 63])
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    q_ref, k_ref = rot(positions, q, k)
    qk = rot.rotate(torch.cat([q, k], dim=1), rot.cos_sin(positions, q.dtype))
    assert torch.equal(qk[:, :4], q_ref) and torch.equal(qk[:, 4:], k_ref)  # same values bit for bit


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotation_is_hf_formula_bit_for_bit(rope):
    """Over our tables (equal to HF's to 1e-6: test_rotary_matches_hf), ``rotate`` computes HF's
    ``q * cos + rotate_half(q) * sin`` exactly, for queries and keys rotated in one pass."""
    from transformers.models.llama.modeling_llama import rotate_half

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_parameters=ROPES[rope]
    )
    ours = RotaryEmbedding(config, head_dim=16)
    positions = torch.tensor([0, 1, 5, 31, 32, 77, 127])
    qk = torch.randn(7, 6, 16) * 3
    cos, sin = ours.cos_cache[positions][:, None], ours.sin_cache[positions][:, None]
    expected = qk * cos + rotate_half(qk) * sin
    assert torch.equal(ours.rotate(qk, ours.cos_sin(positions, qk.dtype)), expected)


def test_tables_limited_to_the_served_length():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096)
    rot = RotaryEmbedding(config, head_dim=16)
    cos, signed_sin = rot.cos_cache.clone(), rot.signed_sin_cache.clone()
    rot.limit_positions(100)
    assert rot.cos_cache.shape == (100, 16) and rot.cos_cache.is_contiguous()
    assert torch.equal(rot.cos_cache, cos[:100]) and torch.equal(rot.signed_sin_cache, signed_sin[:100])
    assert torch.equal(rot.sin_cache[:, 8:], signed_sin[:100, 8:]) and torch.equal(rot.sin_cache[:, :8], -signed_sin[:100, :8])
    rot.limit_positions(5000)  # never longer than the model's context
    assert rot.cos_cache.shape[0] == 100


def test_an_engine_keeps_rotary_rows_for_max_model_len_only(tmp_path):
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.layers.rotary import RotaryEmbedding as Rotary
    from tests.model.tiny_models import make_hf_model

    make_hf_model("llama", seed=0).save_pretrained(tmp_path)  # context: 128 positions
    llm = LLM(str(tmp_path), max_model_len=48, num_threads=1)
    tables = [m.cos_cache.shape[0] for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, Rotary)]
    assert tables and set(tables) == {48}
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=45, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 45  # up to the last served position, 47
