"""The KV disk store on its own: checked reads, atomic writes, the size limit, the fingerprint, a failing disk."""

from __future__ import annotations

import os
import stat

import pytest

from pagedllm.core.block_hash import hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_disk_store import KVDiskStore
from pagedllm.core.kv_disk_tier import DiskTier

FACTS = {"model": "tiny", "dtype": "float32"}
PAYLOAD = 64


def _block(i: int, salt: str | None = None) -> tuple[bytes, tuple[int, ...], bytes]:
    tokens = tuple(range(i * 4, i * 4 + 4))
    return hash_block_tokens(None, tokens, (salt,) if salt else ()), tokens, bytes([i % 256]) * PAYLOAD


def _store(tmp_path, **kw) -> KVDiskStore:
    return KVDiskStore(tmp_path, kw.pop("facts", FACTS), kw.pop("max_bytes", 1 << 20), PAYLOAD)


def test_a_block_comes_back_as_written_and_only_for_its_own_tokens(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    store.store(h, tokens, payload)
    store.flush()
    assert h in store and store.num_blocks == 1
    assert store.read(h, tokens) == payload
    assert store.read(h, (9, 9, 9, 9)) is None  # a hash collision never serves foreign KV
    assert store.stats.hit_blocks == 1 and store.stats.corrupt_blocks == 1
    assert h not in store  # the failing file was dropped


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "flip a header byte"])
def test_a_damaged_file_is_detected_deleted_and_missed(tmp_path, damage):
    store = _store(tmp_path)
    h, tokens, payload = _block(2)
    store.store(h, tokens, payload)
    store.flush()
    path = store._path(h)
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-1] ^= 1
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[0] ^= 1
    path.write_bytes(bytes(data))
    assert store.read(h, tokens) is None
    assert store.stats.corrupt_blocks == 1 and store.stats.miss_blocks == 1
    assert not path.exists() and h not in store


def test_files_are_owner_only_and_a_half_written_block_is_never_indexed(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(3)
    store.store(h, tokens, payload)
    store.flush()
    assert stat.S_IMODE(os.stat(store.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store._path(h)).st_mode) == 0o600
    h2, tokens2, _ = _block(4)
    stray = store._path(h2).with_name(store._path(h2).name + ".123.tmp")  # a writer killed mid-block
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"PKV1 half")
    reopened = _store(tmp_path)
    assert h in reopened and h2 not in reopened and not stray.exists()


def test_a_restart_finds_the_blocks_and_another_fingerprint_never_does(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(5)
    store.store(h, tokens, payload)
    store.close()
    assert _store(tmp_path).read(h, tokens) == payload
    other = _store(tmp_path, facts={**FACTS, "dtype": "bfloat16"})
    assert h not in other and other.read(h, tokens) is None


def test_the_size_limit_evicts_the_least_recently_used(tmp_path):
    probe = _store(tmp_path / "probe")
    h0, t0, p0 = _block(0)
    probe.store(h0, t0, p0)
    probe.flush()
    file_bytes = probe.num_bytes
    store = _store(tmp_path / "s", max_bytes=3 * file_bytes)
    blocks = [_block(i) for i in range(3)]
    for h, t, p in blocks:
        store.store(h, t, p)
    store.flush()
    assert store.read(blocks[0][0], blocks[0][1]) is not None  # block 0 is now the most recent
    h3, t3, p3 = _block(3)
    store.store(h3, t3, p3)
    store.flush()
    assert store.num_bytes <= store.max_bytes
    assert [h in store for h, _, _ in blocks] == [True, False, True] and h3 in store
    assert store.stats.evicted_blocks == 1


def test_a_failing_disk_switches_the_tier_off_and_nothing_raises(tmp_path):
    store = _store(tmp_path)
    for child in store.dir.iterdir():  # the folder turns into something nothing can be written under
        child.unlink()
    store.dir.rmdir()
    store.dir.write_bytes(b"not a folder")
    h, tokens, payload = _block(6)
    store.store(h, tokens, payload)
    store.flush()
    assert not store.enabled and "failed" in store.disabled_reason
    store.store(*_block(7))  # dropped quietly from now on
    assert h not in store and store.read(h, tokens) is None


def test_an_unusable_folder_leaves_the_tier_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    store = KVDiskStore(blocker, FACTS, 1 << 20, PAYLOAD)
    assert not store.enabled and "cannot use" in store.disabled_reason


def test_the_tenant_salt_keeps_blocks_apart_on_disk(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(8, salt="tenant-a")
    store.store(h, tokens, payload)
    store.flush()
    other_tenant, _, _ = _block(8, salt="tenant-b")
    assert h in store and other_tenant not in store


def test_the_tier_spills_evicted_cached_blocks_and_drops_a_load_evicted_in_the_same_step(tmp_path):
    store = _store(tmp_path)
    tier = DiskTier(store, KVCacheManager(4, block_size=4))
    pool = tier.pool
    h, tokens, payload = _block(9)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, h, tokens)
    pool.free_blocks([block])
    pool.get_new_blocks(4)  # every block, so the cached one is evicted
    spill, load = tier.take_step_io()
    assert spill == [block.block_id] and load == []
    tier.complete([payload])
    store.flush()
    assert store.read(h, tokens) == payload
    tier._loads[1] = payload  # a load scheduled, then its block evicted before the step ran
    pool.free_blocks(pool.blocks)
    pool.blocks[1].block_hash, pool.blocks[1].token_ids = h, tokens
    pool.cached_blocks[h] = pool.blocks[1]
    pool.num_cached_free_blocks += 1
    pool.get_new_blocks(4)
    spill, load = tier.take_step_io()
    assert load == [] and spill == []  # neither read back over the new owner nor written again


def test_tensor_parallel_shards_are_files_of_their_own_and_a_block_is_whole_or_missed(tmp_path):
    store = KVDiskStore(tmp_path, FACTS, 1 << 20, 2 * PAYLOAD, num_shards=2)
    assert store.dir != _store(tmp_path).dir  # another rank count, another folder
    blocks = [_block(i) for i in range(3)]
    for h, tokens, _ in blocks:
        store.store(h, tokens, bytes(range(PAYLOAD)) + bytes(range(1, PAYLOAD + 1)))
    store.flush()
    (h0, t0, _), (h1, t1, _), (h2, t2, _) = blocks
    assert store.read(h0, t0) == bytes(range(PAYLOAD)) + bytes(range(1, PAYLOAD + 1))  # rank order
    r0, r1 = store._path(h1, 0), store._path(h1, 1)
    assert r0.name.endswith(".r0.kv") and r1.name.endswith(".r1.kv")
    r1.unlink()  # one rank's shard gone: the block is missed and the other shard dropped too
    assert store.read(h1, t1) is None and not r0.exists() and h1 not in store
    assert store.stats.corrupt_blocks == 1
    store._path(h2, 0).rename(store._path(h2, 1).with_suffix(".swap"))  # rank 1's file named rank 0's:
    store._path(h2, 1).rename(store._path(h2, 0))  # its checksum covers its rank, so it fails
    store._path(h2, 1).with_suffix(".swap").rename(store._path(h2, 1))
    assert store.read(h2, t2) is None and store.stats.corrupt_blocks == 2
    store.store(h1, t1, bytes(2 * PAYLOAD))
    store.flush()
    store._path(h1, 0).unlink()
    store.close()
    reopened = KVDiskStore(tmp_path, FACTS, 1 << 20, 2 * PAYLOAD, num_shards=2)
    assert h0 in reopened and h1 not in reopened  # a block with a shard missing is not indexed
    with pytest.raises(ValueError, match="equal shards"):
        KVDiskStore(tmp_path, FACTS, 1 << 20, 2 * PAYLOAD + 1, num_shards=2)
