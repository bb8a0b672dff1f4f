"""FrontendCore (engine/core_client.py) without a model: one admission path (validation, fan-out, id registry)
and one output path."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm.core.request import EngineCoreRequest, Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.core_client import FrontendCore
from pagedllm.engine.protocol import AddRequestMsg, FrontendMessage
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams

VOCAB_SIZE = 100
MAX_MODEL_LEN = 32


class RecordingCore:
    """An engine core that records what it is sent, and refuses requests whose id starts with 'refuse'."""

    def __init__(self) -> None:
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[tuple[list[str], RequestStatus]] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.req_id.startswith("refuse"):
            raise InvalidRequestError("the whole cache has 0 blocks")
        self.added.append(request)

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.aborted.append((list(req_ids), status))


@pytest.fixture
def frontend() -> FrontendCore:
    return FrontendCore(RecordingCore(), None, VOCAB_SIZE, MAX_MODEL_LEN, eos_token_ids=[2])


def test_the_processor_returns_a_complete_request_and_n_fans_out_in_one_place(frontend):
    params = SamplingParams(n=3, max_tokens=4, seed=7)
    sent = frontend.add_request("r", [5, 6, 7], params, cache_salt="t1")
    assert frontend.core.added == [sent]
    assert (sent.req_id, sent.prompt_token_ids, sent.max_tokens, list(sent.eos_token_ids), sent.cache_salt) == (
        "r", [5, 6, 7], 4, [2], "t1")
    assert sent.sampling_params.sequence_req_ids(sent.req_id) == ["r#0", "r#1", "r#2"]
    assert [frontend.request_id_of(s) for s in ("r#0", "r#2", "r", "x")] == ["r", "r", None, None]
    # the core builds one Request per sequence from the same message, each with its own seed
    requests = Request.for_sequences(sent)
    assert [r.req_id for r in requests] == ["r#0", "r#1", "r#2"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9] and all(r.sampling_params.n == 1 for r in requests)
    assert all(r.eos_token_ids == frozenset({2}) and r.all_token_ids == [5, 6, 7] for r in requests)


def test_the_request_crosses_a_socket_as_typed_msgpack(frontend):
    sent = frontend.add_request("r", [5, 6], SamplingParams(n=2, stop=["x"], logit_bias={3: 1.0}))
    wire = msgspec.msgpack.encode(AddRequestMsg(sent))
    assert msgspec.msgpack.Decoder(FrontendMessage).decode(wire).request == sent


def test_max_tokens_defaults_to_what_max_model_len_leaves(frontend):
    assert frontend.add_request("r", [1] * 10, SamplingParams(max_tokens=None)).max_tokens == MAX_MODEL_LEN - 10


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    ([1, VOCAB_SIZE], SamplingParams(), "outside the vocabulary"),
    ([1, 2], SamplingParams(stop_token_ids=[VOCAB_SIZE]), "outside the vocabulary"),
    ([1] * MAX_MODEL_LEN, SamplingParams(), "must leave room"),
    ([1] * 20, SamplingParams(max_tokens=13), "exceeds max_model_len"),
    ("a text prompt", SamplingParams(), "no tokenizer"),
    ({"neither": 1}, SamplingParams(), "a prompt dict needs"),
    ([1, 2], {"max_tokens": 3}, "must be SamplingParams"),
])
def test_bad_requests_are_refused_at_the_edge_and_nothing_is_registered(frontend, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        frontend.add_request("bad", prompt, params)
    assert frontend.core.added == [] and not frontend.has_unfinished_requests()


def test_ids_are_unique_across_requests_and_their_sequences(frontend):
    frontend.add_request("a", [1, 2], SamplingParams(n=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        frontend.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        frontend.add_request("a#1", [1, 2], SamplingParams())  # would collide with a sequence of "a" in the core
    assert [r.req_id for r in frontend.core.added] == ["a"]


def test_a_request_the_core_refuses_is_unregistered(frontend):
    with pytest.raises(InvalidRequestError, match="whole cache"):
        frontend.add_request("refuse-me", [1, 2], SamplingParams())
    assert not frontend.has_unfinished_requests()
    frontend.add_request("ok", [1, 2], SamplingParams())
    assert frontend.has_unfinished_requests()


def test_outputs_finish_requests_and_aborts_reach_the_core(frontend):
    frontend.add_request("a", [1, 2], SamplingParams(n=2, max_tokens=2))
    frontend.add_request("b", [1, 2], SamplingParams(max_tokens=2))
    (out,) = frontend.process_outputs([EngineCoreOutput("a#0", [7]), EngineCoreOutput("a#1", [8], finish_reason="length")])
    assert out.request_id == "a" and not out.finished
    assert [c.token_ids for c in out.outputs] == [[7], [8]]
    frontend.abort_request("a")  # only the unfinished sequence is aborted in the core
    assert frontend.core.aborted == [(["a#0"], RequestStatus.FINISHED_ABORTED)]
    frontend.abort_request("a")  # unknown now: nothing sent
    assert len(frontend.core.aborted) == 1
    (out,) = frontend.process_outputs([EngineCoreOutput("b", [9, 2], finish_reason="stop")])
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert not frontend.has_unfinished_requests()
