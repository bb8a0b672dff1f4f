"""The KV disk tier on a sliding-window model (a tiny random Mistral, every layer a 16-token window, blocks of 4):
every evicted block is kept, but a prefix hit reads back only the blocks its window reads; greedy outputs are
Hugging Face's and the tier-off engine's, after an eviction and after a restart, at one rank and at two.

    W = 16, blocks of 4, a 64-token prefix (blocks 0..15): the first computed token, at 64, reads keys 49..64,
    so the hit needs blocks 12..15 only (core/kv_cache_manager.py, num_dead_blocks)
"""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import extend_block_hashes
from tests.hf_reference import hf_greedy
from tests.model.tiny_models import WINDOW, make_hf_model, save_hf_model

BLOCK_SIZE = 4
NUM_PREFIX_BLOCKS = 16
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SMALL = dict(block_size=BLOCK_SIZE, num_kv_blocks=24, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf_model = make_hf_model("mistral_window", seed=1, max_position_embeddings=1024)
    hf_model.generation_config.eos_token_id = None
    assert hf_model.config.sliding_window == WINDOW == 16
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("mistral-window-kv-disk"))
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(NUM_PREFIX_BLOCKS * BLOCK_SIZE)]
    first = prefix + [rng.randrange(3, 512) for _ in range(9)]
    again = prefix + [rng.randrange(3, 512) for _ in range(7)]
    fillers = [[rng.randrange(3, 512) for _ in range(60)] for _ in range(4)]
    prompts = [first, *fillers, again]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS).token_ids for p in prompts]
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prefix, BLOCK_SIZE)
    return path, prompts, expected, hashes


def _run(llm: LLM, prompt: list[int]):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_a_windowed_prefix_reads_back_only_its_window(setup, tmp_path):
    path, prompts, expected, hashes = setup
    off = LLM(model=path, **SMALL)
    assert [_run(off, p)[0] for p in prompts] == expected
    del off

    llm = LLM(model=path, kv_disk_cache=str(tmp_path), **SMALL)
    core = llm.engine.core
    assert core.kv_cache_manager.sliding_window == WINDOW
    results = [_run(llm, p) for p in prompts]
    assert [tokens for tokens, _ in results] == expected
    store = core.disk_tier.store
    assert all(h in store for h in hashes)  # every block kept: each is the window of some shorter prefix
    assert results[-1][1] == NUM_PREFIX_BLOCKS * BLOCK_SIZE  # the whole prefix counts as cached ...
    assert core.stats().kv_disk_hit_tokens == WINDOW  # ... from the 4 blocks its window reads
    assert core.check_kv_leaks() == []
    core.shutdown()
    del llm

    store._path(hashes[13]).unlink()  # a block of that window gone: the longest hit whose window is whole
    restarted = LLM(model=path, kv_disk_cache=str(tmp_path), **SMALL)  # ends at block 13 (reads blocks 9..12)
    tokens, num_cached = _run(restarted, prompts[-1])
    assert tokens == expected[-1]
    assert num_cached == 13 * BLOCK_SIZE and restarted.engine.core.stats().kv_disk_hit_tokens == WINDOW
    assert restarted.engine.core.check_kv_leaks() == []


@pytest.mark.slow  # tensor-parallel ranks in worker processes
def test_a_windowed_prefix_at_two_ranks_reads_both_shards_of_its_window_only(setup, tmp_path):
    path, prompts, expected, hashes = setup
    llm = LLM(model=path, kv_disk_cache=str(tmp_path), tensor_parallel_size=2, **SMALL)
    try:
        core = llm.engine.core
        results = [_run(llm, p) for p in prompts]
        assert [tokens for tokens, _ in results] == expected
        assert results[-1][1] == NUM_PREFIX_BLOCKS * BLOCK_SIZE and core.stats().kv_disk_hit_tokens == WINDOW
        assert all(core.disk_tier.store._path(hashes[12], rank).exists() for rank in (0, 1))
        assert core.check_kv_leaks() == []
    finally:
        llm.engine.core.shutdown()
