"""A tiny random Llama (the default tokenizer's vocabulary) for fast benchmark smoke runs."""

from __future__ import annotations

import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir

MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 32  # 512 slots: the 'max' policy (128 tokens) fits 4 requests, paged many more


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(build_tiny_llama_dir(tmp_path_factory.mktemp("bench_tiny_llama"), max_position_embeddings=256))


@pytest.fixture(scope="session")
def tiny_engine_args(tiny_model_dir):
    return dict(model=tiny_model_dir, max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=16,
                max_num_batched_tokens=256)
