"""The KV disk tier at tensor_parallel_size=2: each rank's shard of a block is a file of its own, a block is
read back only when both shards are there and check (otherwise both ranks compute it), and greedy outputs are
the tier-off engine's after an eviction, after a restart, and with a shard damaged or missing on one rank."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import extend_block_hashes
from tests.model.tiny_models import make_hf_model, save_hf_model

pytestmark = pytest.mark.slow  # tensor-parallel ranks in worker processes

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(tensor_parallel_size=2, num_kv_blocks=24, max_num_batched_tokens=256)
"""Too small for the prefix and a filler at once: the fillers evict the prefix."""
BLOCK_SIZE = 16
NUM_PREFIX_BLOCKS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf_model = make_hf_model("llama", seed=3, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=512)
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("tiny-kv-disk-tp"))
    rng = random.Random(3)
    prefix = [rng.randrange(3, 512) for _ in range(NUM_PREFIX_BLOCKS * BLOCK_SIZE)]
    first = prefix + [rng.randrange(3, 512) for _ in range(9)]
    again = prefix + [rng.randrange(3, 512) for _ in range(7)]
    fillers = [[rng.randrange(3, 512) for _ in range(120)] for _ in range(4)]
    prompts = [first, *fillers, again]
    reference = LLM(model=path, **SMALL)  # the same two ranks, the tier off
    try:
        expected = [_run(reference, p) for p in prompts]
    finally:
        reference.engine.core.shutdown()
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prefix, BLOCK_SIZE)
    return path, prompts, expected, hashes


def _run(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _shards(store, block_hash: bytes):
    return [store._path(block_hash, rank) for rank in range(2)]


def test_each_rank_keeps_its_shard_and_a_damaged_or_missing_shard_is_recomputed_on_both(setup, tmp_path):
    path, prompts, expected, hashes = setup
    fillers, again = prompts[1:-1], prompts[-1]

    llm = LLM(model=path, kv_disk_cache=str(tmp_path), **SMALL)
    try:
        assert [_run(llm, p) for p in prompts] == expected
        core = llm.engine.core
        stats = core.stats()
        assert stats.kv_disk_stored_blocks >= NUM_PREFIX_BLOCKS  # spilled when the fillers evicted it
        assert stats.kv_disk_hit_tokens >= NUM_PREFIX_BLOCKS * BLOCK_SIZE  # read back for `again`
        store = core.disk_tier.store
        assert store.num_shards == 2
        shard_bytes = core.kv_info.bytes_per_block
        for block_hash in hashes:
            r0, r1 = _shards(store, block_hash)
            assert r0.stat().st_size == r1.stat().st_size > shard_bytes  # header, tokens, one rank's KV heads
            assert r0.read_bytes()[-shard_bytes:] != r1.read_bytes()[-shard_bytes:]  # different heads
        assert core.check_kv_leaks() == []
    finally:
        llm.engine.core.shutdown()  # keeps what memory holds: both ranks copy their shards out
    rank1_block6 = _shards(store, hashes[6])[1]
    data = bytearray(rank1_block6.read_bytes())
    data[-1] ^= 1
    rank1_block6.write_bytes(bytes(data))

    restarted = LLM(model=path, kv_disk_cache=str(tmp_path), **SMALL)
    try:
        core = restarted.engine.core
        store = core.disk_tier.store
        assert all(h in store for h in hashes)
        assert _run(restarted, again) == expected[-1]  # blocks 0..5 read, 6.. computed on both ranks
        stats = core.stats()
        assert stats.kv_disk_corrupt_blocks == 1 and stats.kv_disk_hit_tokens >= 6 * BLOCK_SIZE
        assert not any(p.exists() for p in _shards(store, hashes[6]))  # both ranks' shards dropped
        _shards(store, hashes[2])[0].unlink()  # rank 0's shard gone while the index still lists the block
        assert [_run(restarted, p) for p in fillers] == expected[1:-1]  # the prefix leaves memory again
        assert _run(restarted, again) == expected[-1]  # blocks 0, 1 read; 2.. computed on both ranks
        stats = core.stats()
        assert stats.kv_disk_corrupt_blocks == 2
        assert hashes[2] not in store and not any(p.exists() for p in _shards(store, hashes[2]))
        assert core.check_kv_leaks() == []
    finally:
        restarted.engine.core.shutdown()
