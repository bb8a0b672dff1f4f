"""AsyncLLM over a fake core client (no process, no model): what a request's stream delivers, and what
closing, failing, a refusal, a lost replica or the core's death do to it and to the core."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.core.request import EngineCoreRequest, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.async_llm import AsyncLLM, RequestFailedError, RequestTimeoutError
from pagedllm.engine.dp_client import ReplicaDeadError, ReplicaLostMsg
from pagedllm.engine.protocol import OutputsMsg, ReadyMsg, RequestRejectedMsg
from pagedllm.errors import EngineDeadError, InvalidRequestError
from pagedllm.metrics import ServerMetrics
from pagedllm.sampling_params import SamplingParams

ABORTED = RequestStatus.FINISHED_ABORTED


class FakeCoreClient:
    """What AsyncLLM needs of a core client; tests push core messages (or an EngineDeadError) with `send`."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[tuple[list[str], RequestStatus]] = []
        self.outbox: asyncio.Queue = asyncio.Queue()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.req_id)

    def abort_requests(self, req_ids, status=ABORTED) -> None:
        self.aborted.append((list(req_ids), status))

    async def get_output(self):
        item = await self.outbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def send(self, msg) -> None:
        self.outbox.put_nowait(msg)

    def is_alive(self) -> bool:
        return True

    def shutdown(self, timeout_s: float = 0) -> None:
        pass


PARAMS = SamplingParams(temperature=0, max_tokens=4)


async def started_engine() -> tuple[AsyncLLM, FakeCoreClient]:
    client = FakeCoreClient()
    engine = AsyncLLM(client, ReadyMsg("m", 128, 1000, [2], 10, 16), tokenizer=None, metrics=ServerMetrics("m"),
                      num_threads=1)
    return engine, client


async def next_output(stream):
    return await asyncio.wait_for(stream.__anext__(), 2)


def run(test) -> None:
    async def with_engine():
        engine, client = await started_engine()
        try:
            await test(engine, client)
        finally:
            await engine.shutdown()

    asyncio.run(with_engine())


def test_outputs_reach_the_stream_and_a_finished_request_leaves_no_trace():
    async def test(engine, client):
        stream = await engine.add_request("r", [5, 6], PARAMS)
        assert client.added == ["r"]
        assert (engine.num_open_requests, engine.num_waiting_requests) == (1, 1)
        client.send(OutputsMsg([EngineCoreOutput("r", [9])]))
        first = await next_output(stream)
        assert (first.request_id, first.outputs[0].token_ids, first.finished) == ("r", [9], False)
        assert (engine.num_open_requests, engine.num_waiting_requests) == (1, 0)  # it runs: no longer waiting
        client.send(OutputsMsg([EngineCoreOutput("r", [8], finish_reason="length")]))
        last = await next_output(stream)
        assert last.finished and last.outputs[0].token_ids == [8]
        with pytest.raises(StopAsyncIteration):
            await next_output(stream)
        assert (engine.num_open_requests, engine.num_waiting_requests) == (0, 0)
        stream.close()
        assert client.aborted == []  # a finished request is not aborted
        assert (await engine.add_request("r", [5], PARAMS)) is not stream  # the id is free again

    run(test)


def test_an_open_id_is_refused_and_closing_an_unfinished_stream_aborts_it_in_the_core():
    async def test(engine, client):
        stream = await engine.add_request("r", [5, 6], SamplingParams(max_tokens=4, n=2))
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.add_request("r", [7], PARAMS)
        stream.close()
        stream.close()  # idempotent
        assert client.aborted == [(["r#0", "r#1"], ABORTED)]
        assert engine.num_open_requests == 0
        with pytest.raises(StopAsyncIteration):
            await next_output(stream)
        client.send(OutputsMsg([EngineCoreOutput("r#0", [9])]))  # late output of the aborted request: dropped
        await asyncio.sleep(0.05)
        assert engine.num_open_requests == 0

    run(test)


def test_fail_aborts_the_request_and_its_stream_raises_the_error_once():
    async def test(engine, client):
        stream = await engine.add_request("r", [5, 6], PARAMS)
        assert stream.fail(RequestTimeoutError("too late"))
        assert client.aborted == [(["r"], ABORTED)]
        assert not stream.fail(RequestTimeoutError("again"))
        with pytest.raises(RequestTimeoutError, match="too late"):
            await next_output(stream)
        with pytest.raises(StopAsyncIteration):
            await next_output(stream)
        stream.close()
        assert engine.num_open_requests == 0
        done = await engine.add_request("d", [5], PARAMS)
        client.send(OutputsMsg([EngineCoreOutput("d", [9], finish_reason="length")]))
        assert (await next_output(done)).finished
        assert not done.fail(RequestTimeoutError("finished already"))

    run(test)


def test_a_refusal_and_a_lost_replica_fail_their_stream_alone():
    async def test(engine, client):
        refused = await engine.add_request("a", [5], PARAMS)
        lost = await engine.add_request("b", [5], PARAMS)
        fine = await engine.add_request("c", [5], PARAMS)
        client.send(RequestRejectedMsg("a", "can never fit the KV cache", invalid_request=True))
        client.send(ReplicaLostMsg("b", ReplicaDeadError("replica 0 died")))
        with pytest.raises(InvalidRequestError, match="never fit"):
            await next_output(refused)
        with pytest.raises(ReplicaDeadError):
            await next_output(lost)
        client.send(RequestRejectedMsg("c", "internal", invalid_request=False))
        with pytest.raises(RequestFailedError, match="internal"):
            await next_output(fine)
        assert engine.num_open_requests == 0

    run(test)


def test_abort_all_ends_every_open_stream_with_the_error():
    async def test(engine, client):
        streams = [await engine.add_request(i, [5], PARAMS) for i in ("a", "b")]
        assert engine.abort_all(RequestFailedError("shutting down")) == 2
        assert sorted(ids for ids, _ in client.aborted) == [["a"], ["b"]]
        for stream in streams:
            with pytest.raises(RequestFailedError, match="shutting down"):
                await next_output(stream)
        assert engine.num_open_requests == 0

    run(test)


def test_the_cores_death_reaches_every_stream_and_every_later_call():
    async def test(engine, client):
        deaths = []
        engine.on_dead = deaths.append
        stream = await engine.add_request("a", [5], PARAMS)
        client.send(EngineDeadError("the engine core process exited"))
        with pytest.raises(EngineDeadError, match="exited"):
            await next_output(stream)
        assert engine.is_dead and len(deaths) == 1
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [5], PARAMS)

    run(test)
