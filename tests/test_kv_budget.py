"""The default KV budget's rule (config/kv_budget.py) as arithmetic: each limit decides where it should, with the
sizes of real models."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, EngineArgs
from pagedllm.config.kv_budget import DEFAULT_KV_TOKENS, KVBudget, default_kv_cache_bytes

GiB, MiB = 2**30, 2**20
# K and V of every layer for one float32 token: 2 * layers * kv_heads * head_dim * 4 bytes
SMOLLM2_135M = 2 * 30 * 3 * 64 * 4  # 46080: the embedded default model
LLAMA_1B = 2 * 16 * 8 * 64 * 4  # 65536: Llama-3.2-1B
TINY = 2 * 2 * 2 * 16 * 4  # 512: the tests' 2-layer model
SMOLLM2_GGUF_BYTES = 98_000_000  # the embedded Q4_1 GGUF
LLAMA_1B_Q4_0_BYTES = 604_000_000  # 1.07B parameters at 4.5 bits (bench/random_gguf.py's llama-3.2-1b, Q4_0)
PLENTY = 64 * GiB


def test_the_default_model_gets_four_times_its_weights_not_gigabytes():
    budget = default_kv_cache_bytes(SMOLLM2_135M, 4096, SMOLLM2_GGUF_BYTES, PLENTY)
    assert budget == KVBudget(4 * SMOLLM2_GGUF_BYTES, "weights")
    assert budget.num_bytes < 400 * MiB
    assert budget.num_bytes // SMOLLM2_135M == 8506  # tokens: two full 4096-token requests and more


def test_a_1b_model_gets_16_requests_of_2k_tokens():
    budget = default_kv_cache_bytes(LLAMA_1B, 4096, LLAMA_1B_Q4_0_BYTES, PLENTY)
    assert budget == KVBudget(DEFAULT_KV_TOKENS * LLAMA_1B, "tokens")
    assert budget.num_bytes // LLAMA_1B >= 16 * 2048
    assert budget.num_bytes == 2 * GiB


def test_a_tiny_model_gets_the_token_target_under_the_256_mib_floor():
    assert default_kv_cache_bytes(TINY, 1024, 10_000, PLENTY) == KVBudget(DEFAULT_KV_TOKENS * TINY, "tokens")
    # a weights cap below 256 MiB is raised to it: 100 KB of weights still get 256 MiB if the tokens need it
    assert default_kv_cache_bytes(16384, 1024, 100_000, PLENTY) == KVBudget(256 * MiB, "weights")


def test_one_max_model_len_request_always_fits_unless_memory_says_no():
    long_context = default_kv_cache_bytes(SMOLLM2_135M, 32768, SMOLLM2_GGUF_BYTES, PLENTY)
    assert long_context == KVBudget(32768 * SMOLLM2_135M, "max_model_len")
    squeezed = default_kv_cache_bytes(SMOLLM2_135M, 32768, SMOLLM2_GGUF_BYTES, 2 * GiB)
    assert squeezed == KVBudget(GiB // 2, "available memory")


def test_a_quarter_of_available_memory_caps_everything_and_unknowns_drop_their_limit():
    assert default_kv_cache_bytes(LLAMA_1B, 4096, LLAMA_1B_Q4_0_BYTES, 4 * GiB) == KVBudget(GiB, "available memory")
    assert default_kv_cache_bytes(LLAMA_1B, 4096, None, None) == KVBudget(2 * GiB, "tokens")
    with pytest.raises(ValueError, match="bytes_per_token and max_model_len must be >= 1"):
        default_kv_cache_bytes(0, 4096, None, None)


def test_unset_or_auto_means_the_rule_and_a_size_replaces_it():
    assert CacheConfig().kv_cache_memory is None
    assert EngineArgs().cache_config().kv_cache_memory is None
    assert EngineArgs(kv_cache_memory="auto").cache_config().kv_cache_memory is None
    assert EngineArgs(kv_cache_memory="2GiB").cache_config().kv_cache_memory == 2 * GiB
