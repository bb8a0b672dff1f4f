"""The engine core carries the KV occupancy gauges in its stats and builds the block map, with no model."""

from __future__ import annotations

import msgspec

from pagedllm.config import EngineArgs
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.core import EngineCore
from pagedllm.engine.protocol import EngineCoreRequest, EngineStatsMsg, KVMapMsg, OutputsMsg
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.interface import Executor, KVCacheInfo, ModelInfo


class _EchoExecutor(Executor):
    """No model: every scheduled request samples token 7 (prompts here fit in one step), and the samples
    forked from a leader whose prompt just finished sample 8."""

    def __init__(self, num_blocks: int = 8) -> None:
        self.model_info = ModelInfo(model_path="stub", hf_config=None,
                                    vocab_size=100, max_position_embeddings=64, eos_token_ids=(2,))
        self.num_blocks = num_blocks

    def initialize_kv_cache(self, cache_config, scheduler_config) -> KVCacheInfo:
        return KVCacheInfo(num_blocks=self.num_blocks, num_host_blocks=0, block_size=cache_config.block_size,
                           bytes_per_block=1000, num_kv_heads=1)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {rid: [7] for rid in sched.num_scheduled_tokens}
        for new in sched.scheduled_new_reqs:
            sampled.update({child_id: [8] for child_id, _ in new.fork_children or ()})
        return ModelRunnerOutput(sampled_token_ids=sampled)


def _request(req_id: str, prompt: list[int], max_tokens: int, n: int = 1, priority: int = 0) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params, [2], max_tokens, priority=priority)


def test_stats_and_map_follow_a_parallel_sampling_request_to_idle():
    core = EngineCore(EngineArgs(block_size=4, enable_prefix_caching=True), executor=_EchoExecutor(8))
    core.add_request(_request("a", list(range(10, 21)), max_tokens=3, n=2))  # 11 tokens: blocks 4, 4, 3
    core.add_request(_request("w", list(range(40, 49)), max_tokens=1))
    core.step()
    stats = core.stats()
    # a's two samples share its three blocks; w (max_tokens 1) finished: its two full blocks stay cached
    assert (stats.kv_num_blocks, stats.kv_num_used_blocks, stats.kv_num_cached_blocks, stats.kv_num_empty_blocks,
            stats.kv_num_filled_slots, stats.kv_num_allocated_slots, stats.kv_num_shared_blocks,
            stats.kv_num_saved_blocks, stats.kv_saved_bytes) == (8, 3, 2, 3, 11, 12, 3, 3, 3000)
    assert stats.num_steps == 1 and stats.num_scheduled_tokens == 20
    assert stats.kv_blocks_by_priority == {0: 6}
    kv_map = core.kv_map()
    assert kv_map.ref_cnts[:6] == [2, 2, 2, 0, 0, 0] and kv_map.num_tokens[:6] == [4, 4, 3, 4, 4, 0]
    assert kv_map.cached_block_ids == [3, 4]
    running = {r.req_id: r for r in kv_map.requests}
    assert set(running) == {"a#0", "a#1"} and running["a#1"].block_ids == [0, 1, 2]  # w finished (max_tokens 1)
    assert all(r.state == "running" and r.num_computed_tokens == 11 for r in kv_map.requests)
    # the map crosses the socket as msgpack inside the stats
    wire = msgspec.msgpack.encode(OutputsMsg([], msgspec.structs.replace(stats, kv_map=kv_map)))
    back = msgspec.msgpack.decode(wire, type=OutputsMsg)
    assert back.stats.kv_map == kv_map and isinstance(back.stats.kv_map, KVMapMsg)
    while core.has_unfinished_requests():
        core.step()
    stats = core.stats()
    assert (stats.kv_num_used_blocks, stats.kv_num_filled_slots, stats.kv_num_shared_blocks, stats.kv_saved_bytes,
            stats.kv_blocks_by_priority) == (0, 0, 0, 0, {})
    # full blocks stay cached: w's two, a's two prompt blocks, and each sample's third block (prompt + its own
    # first token, 8 or 7: two different blocks); the samples' fourth blocks (2 of 4 slots) are empty again
    assert stats.kv_num_cached_blocks == 6 and stats.kv_num_empty_blocks == 2
    kv_map = core.kv_map()
    assert kv_map.requests == [] and set(kv_map.ref_cnts) == {0} and len(kv_map.cached_block_ids) == 6
    # a cached block holds a full block of KV, an empty one nothing
    assert [kv_map.num_tokens[b] for b in kv_map.cached_block_ids] == [4] * 6 and sum(kv_map.num_tokens) == 24
    assert core.check_kv_leaks() == []


def test_waiting_requests_appear_in_the_map_with_no_blocks():
    core = EngineCore(EngineArgs(block_size=4, max_num_seqs=1), executor=_EchoExecutor(8))
    core.add_request(_request("a", [5, 6, 7, 8, 9], max_tokens=2))
    core.add_request(_request("b", [5, 6], max_tokens=2, priority=0))
    core.step()
    states = {r.req_id: (r.state, r.block_ids, r.num_tokens) for r in core.kv_map().requests}
    assert states == {"a": ("running", [0, 1], 6), "b": ("waiting", [], 2)}
    assert isinstance(core.stats(), EngineStatsMsg)
