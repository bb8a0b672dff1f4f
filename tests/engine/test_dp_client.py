"""DPCoreClient over fake replicas (no processes): request -> replica mapping, aborts, stats totals, and
what a replica's death does to its in-flight requests (re-sent before the first token, failed after)."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.config import EngineArgs
from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.dp_client import DPCoreClient, ReplicaDeadError, ReplicaLostMsg, ReplicaState
from pagedllm.engine.protocol import EngineStatsMsg, KVMapMsg, OutputsMsg, ReadyMsg
from pagedllm.errors import EngineDeadError
from pagedllm.metrics.prometheus import ServerMetrics
from pagedllm.sampling_params import SamplingParams


def ready(num_blocks: int) -> ReadyMsg:
    return ReadyMsg("m", 128, 1000, [2], num_blocks, 16)


def stats(running: int, usage: float, hits: int, queries: int) -> EngineStatsMsg:
    return EngineStatsMsg(running, 0, usage, 0, queries, hits, 0)


class FakeReplica:
    """What DPCoreClient needs of a core client; `die()` makes get_output raise as a dead core's would."""

    def __init__(self, num_blocks: int, can_restart: bool = False) -> None:
        self.num_blocks = num_blocks
        self.can_restart = can_restart
        self.added: list[str] = []
        self.aborted: list[tuple[list[str], RequestStatus]] = []
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.restarted: asyncio.Event = asyncio.Event()

    async def wait_ready(self, timeout_s: float = 0) -> ReadyMsg:
        return ready(self.num_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.req_id)

    def abort_requests(self, req_ids, status=RequestStatus.FINISHED_ABORTED) -> None:
        self.aborted.append((list(req_ids), status))

    async def get_output(self):
        item = await self.outbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def die(self) -> None:
        self.outbox.put_nowait(EngineDeadError("the engine core process exited unexpectedly"))

    async def wait_restarted(self) -> ReadyMsg:
        await self.restarted.wait()
        return ready(self.num_blocks)

    def shutdown(self, timeout_s: float = 0) -> None:
        pass


def request(req_id: str, n: int = 1) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, [5] * 20, SamplingParams(temperature=0, max_tokens=4, n=n), [2], 4)


async def started_client(*replicas: FakeReplica) -> DPCoreClient:
    client = DPCoreClient(EngineArgs(data_parallel_size=len(replicas)), replicas=list(replicas))
    total = await client.wait_ready()
    assert total.num_blocks == sum(r.num_blocks for r in replicas)
    return client


async def next_msg(client: DPCoreClient):
    return await asyncio.wait_for(client.get_output(), 2)


def test_requests_stay_on_their_replica_and_stats_are_totals():
    async def run():
        r0, r1 = FakeReplica(10), FakeReplica(30)
        client = await started_client(r0, r1)
        client.add_request(request("a"))
        client.add_request(request("b", n=2))
        assert (r0.added, r1.added) == (["a"], ["b"])
        assert client.router.loads == [1, 2]
        client.abort_requests(["b#1"])
        assert r1.aborted == [(["b#1"], RequestStatus.FINISHED_ABORTED)] and r0.aborted == []
        # a's output from replica 1 is stale (a lives on 0) and is dropped
        r1.outbox.put_nowait(OutputsMsg([EngineCoreOutput("a", [9]), EngineCoreOutput("b#0", [7])],
                                        stats(1, 0.5, 16, 32)))
        msg = await next_msg(client)
        assert [o.req_id for o in msg.outputs] == ["b#0"]
        r0.outbox.put_nowait(OutputsMsg([EngineCoreOutput("a", [3], finish_reason="length")], stats(0, 0.1, 0, 16)))
        msg = await next_msg(client)
        assert [o.req_id for o in msg.outputs] == ["a"]
        total = msg.stats
        assert (total.num_running, total.prefix_cache_hits, total.prefix_cache_queries) == (1, 16, 48)
        assert total.kv_cache_usage == pytest.approx((0.1 * 10 + 0.5 * 30) / 40)
        assert client.router.loads == [0, 1]  # a finished, b#1 aborted, b#0 running
        client.shutdown()

    asyncio.run(run())


def test_a_dead_replica_resends_unstarted_requests_and_fails_started_ones():
    async def run():
        r0, r1 = FakeReplica(10), FakeReplica(10)
        client = await started_client(r0, r1)
        for req_id in ("a", "b", "c"):  # a -> 0, b -> 1, c -> 0
            client.add_request(request(req_id))
        r0.outbox.put_nowait(OutputsMsg([EngineCoreOutput("a", [4])]))
        await next_msg(client)  # a has started, c has not
        r0.die()
        lost = await next_msg(client)
        assert isinstance(lost, ReplicaLostMsg) and lost.req_id == "a"
        assert isinstance(lost.error, ReplicaDeadError) and "replica 0 died" in str(lost.error)
        assert r1.added == ["b", "c"]  # c re-sent to the survivor
        assert client.states == [ReplicaState.DOWN, ReplicaState.UP] and client.is_alive()
        client.add_request(request("d"))
        assert r1.added == ["b", "c", "d"] and client.router.loads == [0, 3]
        client.abort_requests(["a"])  # the front end closing a's stream: nothing is sent to the dead replica
        assert r0.aborted == []
        r1.die()
        with pytest.raises(EngineDeadError, match="every engine replica is down"):
            # c and d had not started: nowhere to re-send them, so they fail too
            while True:
                msg = await next_msg(client)
                assert isinstance(msg, ReplicaLostMsg) and msg.req_id in ("b", "c", "d")
        with pytest.raises(EngineDeadError):
            client.add_request(request("e"))
        assert not client.is_alive()
        client.shutdown()

    asyncio.run(run())


def test_a_restarted_replica_rejoins_and_counters_never_go_back():
    async def run():
        r0, r1 = FakeReplica(10, can_restart=True), FakeReplica(10)
        client = await started_client(r0, r1)
        r0.outbox.put_nowait(OutputsMsg([], stats(0, 0.0, 16, 32)))
        assert (await next_msg(client)).stats.prefix_cache_hits == 16
        r0.die()
        await asyncio.sleep(0.05)
        assert client.states[0] is ReplicaState.RESTARTING and client.is_alive()
        client.add_request(request("a"))
        assert r1.added == ["a"] and r0.added == []
        r0.restarted.set()
        await asyncio.sleep(0.05)
        assert client.states[0] is ReplicaState.UP
        client.add_request(request("b"))
        assert r0.added == ["b"]  # the least loaded again
        r0.outbox.put_nowait(OutputsMsg([], stats(0, 0.0, 0, 16)))  # a fresh core counts from zero
        total = (await next_msg(client)).stats
        assert (total.prefix_cache_hits, total.prefix_cache_queries) == (16, 48)
        client.shutdown()

    asyncio.run(run())


def every_field_stats(scale: int, per_position: list[int]) -> EngineStatsMsg:
    """Stats with every field non-zero, built from the struct's own fields (so a new field is covered too):
    int field number k holds scale * (k + 1)."""
    values = {}
    for k, name in enumerate(EngineStatsMsg.__struct_fields__):
        if name == "kv_cache_usage":
            values[name] = 0.25 * scale
        elif name.endswith("_per_position"):
            values[name] = list(per_position)
        elif name == "kv_blocks_by_priority":
            values[name] = {0: scale, scale: 10}
        elif name == "kv_map":
            values[name] = KVMapMsg(0.0, 4, [scale], [1], [], [], 1, 1, 0, 0, 0, 0)
        else:
            values[name] = scale * (k + 1)
    return EngineStatsMsg(**values)


def test_totals_merge_every_stats_field():
    """Every int field is a sum over the replicas (gauges over the live ones, counters over every incarnation,
    which are the same while none died); per-position lists add up position by position, the shorter one
    padded with zeros; KV usage is weighted by each replica's block count."""
    async def run():
        r0, r1 = FakeReplica(10), FakeReplica(30)
        client = await started_client(r0, r1)
        a, b = every_field_stats(1, [4, 2, 1]), every_field_stats(2, [5])
        r0.outbox.put_nowait(OutputsMsg([], a))
        await next_msg(client)
        r1.outbox.put_nowait(OutputsMsg([], b))
        total = (await next_msg(client)).stats
        for k, name in enumerate(EngineStatsMsg.__struct_fields__):
            if name == "kv_cache_usage":
                assert total.kv_cache_usage == pytest.approx((0.25 * 10 + 0.5 * 30) / 40)
            elif name.endswith("_per_position"):
                assert getattr(total, name) == [9, 2, 1], name
            elif name == "kv_blocks_by_priority":  # summed priority by priority
                assert total.kv_blocks_by_priority == {0: 3, 1: 10, 2: 10}
            elif name == "kv_map":  # each replica's own map goes to the metrics; the total has none
                assert total.kv_map is None
            else:
                assert getattr(total, name) == 3 * (k + 1), name
        # end to end: the totals reach /metrics (the beam and speculative-decoding series were 0 here)
        metrics = ServerMetrics("m")
        metrics.record_engine_stats(total)
        text = metrics.render().decode()
        for name, field in (("pagedllm_beam_search_requests_running", "num_beam_groups"),
                            ("pagedllm_beam_search_group_preemptions_total", "num_beam_group_preemptions"),
                            ("pagedllm_spec_decode_num_accepted_tokens_total", "spec_num_accepted_tokens")):
            assert f'{name}{{model_name="m"}} {float(getattr(total, field))}' in text, name
        assert 'pagedllm_spec_decode_num_proposed_tokens_per_pos_total{model_name="m",position="0"} 9.0' in text
        client.shutdown()

    asyncio.run(run())


def test_counters_of_a_dead_replica_stay_in_the_totals_and_its_gauges_leave():
    async def run():
        r0, r1 = FakeReplica(10), FakeReplica(10)
        client = await started_client(r0, r1)
        r0.outbox.put_nowait(OutputsMsg([], every_field_stats(1, [4, 2])))
        await next_msg(client)
        r0.die()
        await asyncio.sleep(0.05)
        r1.outbox.put_nowait(OutputsMsg([], every_field_stats(2, [5])))
        total = (await next_msg(client)).stats
        fields = EngineStatsMsg.__struct_fields__
        assert total.num_running == 2 * (fields.index("num_running") + 1)  # a gauge: replica 1's only
        assert total.num_beams_running == 2 * (fields.index("num_beams_running") + 1)
        assert total.spec_num_draft_tokens == 3 * (fields.index("spec_num_draft_tokens") + 1)  # a counter: both
        assert total.num_beam_group_preemptions == 3 * (fields.index("num_beam_group_preemptions") + 1)
        assert total.spec_accepted_per_position == [9, 2]
        assert total.kv_cache_usage == pytest.approx(0.5)
        client.shutdown()

    asyncio.run(run())
