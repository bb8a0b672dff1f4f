"""Tiny seeded random checkpoints of every supported architecture, saved as Hugging Face
directories for tests. Weights are drawn large (``initializer_range``) so logits sit far from ties."""

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    vocab_size=512,
    max_position_embeddings=256,
    initializer_range=0.2,  # large weights: logits far from ties, so greedy comparisons are stable
    rms_norm_eps=1e-5,
)


def tiny_config(kind: str, **overrides):
    config = _tiny_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _tiny_config(kind: str):
    if kind == "llama":  # GQA, untied
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **COMMON)
    if kind == "llama_tied_scaled":  # tied, explicit head_dim != hidden/heads, llama3 rope scaling
        return LlamaConfig(
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
            **COMMON,
        )
    if kind == "llama_tied":  # tied, explicit head_dim != hidden/heads, plain rope (GGUF tests)
        return LlamaConfig(
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, **COMMON
        )
    if kind == "qwen2":  # q/k/v bias
        return Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **COMMON)
    if kind == "mistral":
        return MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, **COMMON)
    if kind == "mistral_window":  # every layer windowed
        return MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, **COMMON)
    if kind == "qwen3":  # q/k norm, explicit head_dim, no bias
        return Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                           **COMMON)
    if kind in ("qwen3_moe", "qwen3_moe_unnormalized"):  # 8 experts, top-2; layer 1 dense
        return Qwen3MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=48, norm_topk_prob=kind == "qwen3_moe", decoder_sparse_step=1,
            mlp_only_layers=[1], tie_word_embeddings=False, **COMMON,
        )
    if kind == "mixtral":  # 4 experts, top-2, windowed attention
        return MixtralConfig(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=WINDOW, **COMMON)
    if kind == "gemma2":  # local/global alternating, both soft-caps
        return Gemma2Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            **{**COMMON, "num_hidden_layers": 4},
        )
    if kind == "gemma3":  # q/k norms, local/global rotary bases (global linear-scaled, as Gemma 3 4B+),
        # 3 local layers then a global one
        return Gemma3TextConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=10000.0,
            **{**COMMON, "num_hidden_layers": 4},
        )
    if kind == "phi3":  # fused qkv / gate_up; longrope (positions under the original length: short factors)
        head_dim = COMMON["hidden_size"] // 4
        return Phi3Config(
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            original_max_position_embeddings=512,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0 + 0.1 * i for i in range(head_dim // 2)],
                             "long_factor": [2.0 + 0.5 * i for i in range(head_dim // 2)],
                             "original_max_position_embeddings": 512},
            **{**COMMON, "max_position_embeddings": 1024},
        )
    raise ValueError(kind)


WINDOW = 16
"""The sliding window of the tiny windowed models: one block of 16, so prompts span many windows."""


def make_hf_model(kind: str, seed: int = 0, **config_overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **config_overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # HF zero-initializes biases; make them matter
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def save_hf_model(model, path) -> str:
    model.save_pretrained(str(path))
    return str(path)
