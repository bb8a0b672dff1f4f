"""Loading a prefix from disk while other requests run: the request waits aside for its own blocks (read on the
store's reader thread, held back here by a gate on the store's file reads), the others keep their steps, and
every block comes back to the pool however the load ends."""

from __future__ import annotations

import threading
from pathlib import Path

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_disk_store import KVDiskStore
from pagedllm.core.kv_disk_tier import DiskTier
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler

from .helpers import make_request, sample_for

PAYLOAD = 32
NUM_BLOCKS = 16


class Gate:
    """The store's file reads wait for `open()`; counts the files read."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.num_reads = 0

    def __call__(self, path: Path) -> bytes:
        assert self.event.wait(10), "the gate was never opened"
        self.num_reads += 1
        return path.read_bytes()


def _setup(tmp_path, sliding_window: int | None = None):
    store = KVDiskStore(tmp_path, {"model": "tiny"}, 1 << 20, PAYLOAD)
    kv = KVCacheManager(NUM_BLOCKS, block_size=4, sliding_window=sliding_window)
    tier = DiskTier(store, kv)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(config, kv, disk_tier=tier)
    gate = Gate()
    store.read_file = gate
    return store, kv, tier, sched, gate


def _put_on_disk(store: KVDiskStore, kv: KVCacheManager, num_prompt_tokens: int) -> list[bytes]:
    """The full blocks of a `make_request(num_prompt_tokens)` prompt (but the last token's), stored; their payloads."""
    request = make_request(num_prompt_tokens)
    payloads = []
    for i in range(kv.max_prefix_hit_blocks(request)):
        payloads.append(bytes([i + 1]) * PAYLOAD)
        store.store(request.block_hashes[i], tuple(request.all_token_ids[i * 4:(i + 1) * 4]), payloads[-1])
    store.flush()
    return payloads


def _step(sched: Scheduler, tier: DiskTier):
    out = sched.schedule()
    out.kv_spill, out.kv_load = tier.take_step_io()
    sched.update_from_output(out, sample_for(sched, out))
    return out


def _wait_for_reads(tier: DiskTier) -> None:
    while tier.store.num_reads_pending:
        tier.wait_for_reads(1.0)


def test_a_request_waits_for_its_blocks_while_another_keeps_decoding(tmp_path):
    store, kv, tier, sched, gate = _setup(tmp_path)
    payloads = _put_on_disk(store, kv, 13)  # 3 blocks of 4 on disk; the 13th token is computed
    running = make_request(5, max_tokens=20, first_token=500)
    sched.add_request(running)
    _step(sched, tier)
    loading = make_request(13, max_tokens=2)
    sched.add_request(loading)
    for _ in range(4):  # the reads are held back: the running request steps on alone
        out = _step(sched, tier)
        assert out.num_scheduled_tokens == {running.req_id: 1} and out.kv_load == []
        assert sched.loading == [loading] and loading.status == RequestStatus.WAITING and sched.num_waiting == 1
    assert kv.num_free_blocks == NUM_BLOCKS - 3 - 3  # the running request's 3, and 3 reserved for the reads
    gate.event.set()
    _wait_for_reads(tier)
    out = _step(sched, tier)
    assert out.num_scheduled_tokens == {running.req_id: 1, loading.req_id: 1}  # only its last token computed
    table = kv.get_block_ids(loading.req_id)
    assert out.kv_load == list(zip(table[:3], payloads))  # written before the forward pass that reads them
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12 and tier.hit_tokens == 12
    assert sched.loading == [] and gate.num_reads == 3
    while sched.has_unfinished_requests():
        _step(sched, tier)
    assert kv.check_no_leaks() == []


def test_requests_on_the_same_prefix_share_one_read_and_a_new_one_overtakes_them(tmp_path):
    store, kv, tier, sched, gate = _setup(tmp_path)
    _put_on_disk(store, kv, 9)
    first, second = make_request(9, max_tokens=1), make_request(9, max_tokens=1)
    other = make_request(6, max_tokens=1, first_token=700)  # nothing on disk: admitted at once
    for r in (first, second, other):
        sched.add_request(r)
    out = _step(sched, tier)
    assert out.num_scheduled_tokens == {other.req_id: 6} and sched.loading == [first, second]
    gate.event.set()
    _wait_for_reads(tier)
    out = _step(sched, tier)
    assert out.num_scheduled_tokens == {first.req_id: 1, second.req_id: 1} and gate.num_reads == 2
    assert kv.get_block_ids(first.req_id)[:2] == kv.get_block_ids(second.req_id)[:2]  # the same loaded blocks
    assert kv.check_no_leaks() == []  # max_tokens=1: both finished in that step


def test_abort_while_loading_gives_every_block_back(tmp_path):
    store, kv, tier, sched, gate = _setup(tmp_path)
    _put_on_disk(store, kv, 13)
    sched.add_request(make_request(4, max_tokens=1, first_token=800))
    sched.add_request(loading := make_request(13, max_tokens=2))
    _step(sched, tier)
    assert sched.loading == [loading]
    sched.finish_requests([loading.req_id], RequestStatus.FINISHED_ABORTED)
    assert sched.loading == [] and not sched.has_unfinished_requests()
    assert kv.check_no_leaks() == []  # the blocks reserved for its reads are free before the reads end
    gate.event.set()
    _wait_for_reads(tier)
    assert tier.poll() == [] and tier.take_step_io() == ([], [])  # the late bytes go nowhere
    assert kv.check_no_leaks() == []


def test_a_block_that_fails_its_check_is_computed_and_its_neighbours_still_load(tmp_path):
    store, kv, tier, sched, gate = _setup(tmp_path)
    _put_on_disk(store, kv, 13)
    request = make_request(13, max_tokens=1)
    kv.max_prefix_hit_blocks(request)
    path = store._path(request.block_hashes[1])
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    sched.add_request(request)
    _step(sched, tier)
    gate.event.set()
    _wait_for_reads(tier)
    out = _step(sched, tier)
    assert out.num_scheduled_tokens == {request.req_id: 9}  # block 0 from disk; blocks 1.. computed
    assert len(out.kv_load) == 2 and store.stats.corrupt_blocks == 1  # blocks 0 and 2 came back; 2 is unused
    assert kv.check_no_leaks() == []


def test_the_memory_hits_before_the_disk_run_are_held_while_it_loads(tmp_path):
    store, kv, tier, sched, gate = _setup(tmp_path)
    head = make_request(5, max_tokens=1)  # the same first block, computed: cached in memory
    sched.add_request(head)
    _step(sched, tier)
    _put_on_disk(store, kv, 13)
    sched.add_request(loading := make_request(13, max_tokens=2))
    _step(sched, tier)
    assert gate.num_reads == 0 and len(tier._reads) == 2  # blocks 1 and 2 only: block 0 is in memory
    hit = kv.pool.cached_blocks[loading.block_hashes[0]]
    assert hit.ref_cnt == 1  # held by the load: no eviction can take it meanwhile
    gate.event.set()
    _wait_for_reads(tier)
    out = _step(sched, tier)
    assert out.num_scheduled_tokens == {loading.req_id: 1} and kv.get_block_ids(loading.req_id)[0] == hit.block_id
    _step(sched, tier)
    assert kv.check_no_leaks() == []


def test_with_a_sliding_window_only_the_blocks_the_window_reads_are_loaded_or_held(tmp_path):
    """W = 8, blocks of 4, 33 prompt tokens: the hit at 32 needs blocks 6 and 7 only (the token at 32 reads keys
    25..32). Block 6 is in memory, 5 and 7 on disk, 0..4 nowhere: block 7 is read, 6 held, 5 left alone."""
    store, kv, tier, sched, gate = _setup(tmp_path, sliding_window=8)
    request = make_request(33, max_tokens=2)
    kv.max_prefix_hit_blocks(request)
    tokens = [tuple(request.all_token_ids[i * 4:(i + 1) * 4]) for i in range(8)]
    for i in (5, 7):
        store.store(request.block_hashes[i], tokens[i], bytes([i]) * PAYLOAD)
    store.flush()
    (in_memory,) = kv.pool.get_new_blocks(1)
    kv.pool.set_num_tokens(in_memory, 4)
    kv.pool.cache_block(in_memory, request.block_hashes[6], tokens[6])
    kv.pool.free_blocks([in_memory])
    sched.add_request(request)
    _step(sched, tier)
    assert sched.loading == [request] and list(tier._reads) == [request.block_hashes[7]]
    assert in_memory.ref_cnt == 1  # held by the load
    gate.event.set()
    _wait_for_reads(tier)
    out = _step(sched, tier)
    assert out.num_scheduled_tokens == {request.req_id: 1} and out.scheduled_new_reqs[0].num_computed_tokens == 32
    table = kv.get_block_ids(request.req_id)
    assert table[:6] == [kv.null_block.block_id] * 6 and table[6] == in_memory.block_id
    assert out.kv_load == [(table[7], bytes([7]) * PAYLOAD)] and gate.num_reads == 1 and tier.hit_tokens == 4
    _step(sched, tier)
    assert kv.check_no_leaks() == []
