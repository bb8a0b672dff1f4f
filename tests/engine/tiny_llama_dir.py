"""A tiny random Llama directory with the default model's tokenizer: fast engines for tests."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def default_model_dir() -> Path:
    """The converted embedded default model (converted on first use)."""
    from pagedllm.model.loader import DEFAULT_MODEL_DIRNAME, cache_root, default_gguf_path, ensure_converted

    return Path(ensure_converted(default_gguf_path(), cache_root() / DEFAULT_MODEL_DIRNAME))


def build_tiny_llama_dir(path: Path, max_position_embeddings: int = 1024, seed: int = 0,
                         initializer_range: float = 0.02) -> Path:
    """Save a seeded 2-layer GQA Llama (vocab 49152, the default tokenizer's) with a chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = default_model_dir()
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path
