"""Tiny seeded random Llama-family checkpoints, saved as Hugging Face directories for tests."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

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
    raise ValueError(kind)


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
