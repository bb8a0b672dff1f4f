"""Request limits (RequestLimits, checked once at the edge) and sampling values that must be finite and in range."""

from __future__ import annotations

import argparse
import math

import pytest

from pagedllm.config import EngineArgs, RequestLimits
from pagedllm.engine.core_client import FrontendCore
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams

VOCAB_SIZE = 1000
MAX_MODEL_LEN = 64


class NullCore:
    def __init__(self) -> None:
        self.added = []

    def add_request(self, request) -> None:
        self.added.append(request)

    def abort_requests(self, req_ids, status=None) -> None:
        pass


LIMITS = RequestLimits(max_stop_token_ids=4, max_logit_bias=3, max_stop_strings=2, max_stop_string_chars=5,
                       max_logprobs=2, max_sequences_per_request=6, max_prompt_logprobs_positions=8)


@pytest.fixture
def frontend() -> FrontendCore:
    return FrontendCore(NullCore(), None, VOCAB_SIZE, MAX_MODEL_LEN, eos_token_ids=[2], limits=LIMITS)


AT_THE_LIMIT = dict(stop_token_ids=[10, 11, 12, 13], logit_bias={1: 1.0, 2: 2.0, 3: 3.0}, stop=["abcde", "x"],
                    logprobs=2, prompt_logprobs=2, n=2, best_of=6)


def test_a_request_at_every_limit_is_accepted(frontend):
    sent = frontend.add_request("ok", [5] * 8, SamplingParams(max_tokens=4, **AT_THE_LIMIT))
    assert frontend.core.added == [sent] and len(sent.sampling_params.sequence_req_ids(sent.req_id)) == 6


@pytest.mark.parametrize("change, limit_name", [
    (dict(stop_token_ids=[10, 11, 12, 13, 14]), "max_stop_token_ids is 4"),
    (dict(logit_bias={1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}), "max_logit_bias is 3"),
    (dict(stop=["a", "b", "c"]), "max_stop_strings is 2"),
    (dict(stop=["abcdef"]), "max_stop_string_chars is 5"),
    (dict(logprobs=3), "logprobs is 3; the limit max_logprobs is 2"),
    (dict(prompt_logprobs=3), "prompt_logprobs is 3; the limit max_logprobs is 2"),
    (dict(n=2, best_of=7), "7 sequences .* max_sequences_per_request is 6"),
    (dict(n=7, best_of=None), "7 sequences .* max_sequences_per_request is 6"),
])
def test_one_past_each_limit_is_refused_naming_the_limit(frontend, change, limit_name):
    params = SamplingParams(max_tokens=4, **{**AT_THE_LIMIT, **change})
    with pytest.raises(InvalidRequestError, match=limit_name):
        frontend.add_request("bad", [5] * 8, params)
    assert frontend.core.added == [] and not frontend.has_unfinished_requests()


def test_prompt_logprobs_positions_are_bounded(frontend):
    with pytest.raises(InvalidRequestError, match="9 tokens; the limit max_prompt_logprobs_positions is 8"):
        frontend.add_request("bad", [5] * 9, SamplingParams(max_tokens=4, prompt_logprobs=0))
    frontend.add_request("ok", [5] * 9, SamplingParams(max_tokens=4))  # no prompt logprobs: no bound


def test_sequences_count_every_prompt_of_a_request(frontend):
    """The server checks prompts x max(n, best_of) once for a multi-prompt request."""
    processor = frontend.input_processor
    processor.check_limits(SamplingParams(n=2), num_prompts=3)
    with pytest.raises(InvalidRequestError, match=r"8 sequences \(4 prompt\(s\) x max\(n, best_of\) = 2\)"):
        processor.check_limits(SamplingParams(n=2), num_prompts=4)


def test_limits_are_checked_before_the_ids_are_scanned(frontend):
    """A million stop ids is refused by its length, not walked against the vocabulary."""
    with pytest.raises(InvalidRequestError, match="max_stop_token_ids"):
        frontend.add_request("bad", [5], SamplingParams(stop_token_ids=[VOCAB_SIZE + 1] * 1_000_000))


def test_min_tokens_is_checked_against_the_resolved_max_tokens(frontend):
    with pytest.raises(InvalidRequestError, match=r"min_tokens \(60\) exceeds the 56 tokens"):
        frontend.add_request("bad", [5] * 8, SamplingParams(max_tokens=None, min_tokens=60))


def test_a_lone_surrogate_in_a_prompt_is_an_invalid_request():
    class Tokenizer:
        def encode(self, text):
            raise AssertionError("never reached")

    frontend = FrontendCore(NullCore(), Tokenizer(), VOCAB_SIZE, MAX_MODEL_LEN, eos_token_ids=[2])
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        frontend.add_request("bad", "abc\ud800", SamplingParams())


def test_default_limits_and_each_is_a_flag():
    limits = EngineArgs().request_limits()
    assert limits == RequestLimits()
    assert (limits.max_logit_bias, limits.max_sequences_per_request, limits.max_logprobs) == (300, 256, 20)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--max-stop-token-ids", "7", "--max-logit-bias", "9",
                                                       "--max-sequences-per-request", "32"]))
    assert args.request_limits() == RequestLimits(max_stop_token_ids=7, max_logit_bias=9, max_sequences_per_request=32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_logprobs=21), "max_logprobs must be <= 20"),
    (dict(max_stop_strings=65), "max_stop_strings must be <= 64"),
    (dict(max_sequences_per_request=0), "max_sequences_per_request must be >= 1"),
    (dict(max_logit_bias=-1), "max_logit_bias must be an integer >= 0"),
])
def test_bad_limits_are_refused_when_configured(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RequestLimits(**kwargs)
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


# --- sampling values --------------------------------------------------------------------------------

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=INF), "temperature"),
    (dict(temperature=NAN), "temperature"),
    (dict(temperature=101.0), "temperature"),
    (dict(temperature=10**400), "temperature"),
    (dict(top_p=NAN), "top_p"),
    (dict(top_p=INF), "top_p"),
    (dict(min_p=NAN), "min_p"),
    (dict(min_p=-INF), "min_p"),
    (dict(presence_penalty=INF), "presence_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=NAN), "frequency_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=1e-300), "repetition_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=INF), "repetition_penalty"),
    (dict(repetition_penalty=1000.0), "repetition_penalty"),
    (dict(logit_bias={1: INF}), "logit_bias values"),
    (dict(logit_bias={1: NAN}), "logit_bias values"),
    (dict(logit_bias={1: 101}), "logit_bias values"),
    (dict(logit_bias=[1, 2]), "logit_bias must map"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(top_k=0), "top_k"),
    (dict(stop=["ok\udc80"]), "stop strings must be valid Unicode"),
    (dict(stop=5), "stop must be a list"),
    (dict(stop_token_ids={1: 2}), "stop_token_ids must be a list"),
])
def test_non_finite_or_absurd_sampling_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=100.0), dict(repetition_penalty=0.01), dict(repetition_penalty=100),
    dict(presence_penalty=-2, frequency_penalty=2), dict(logit_bias={3: -100, 4: 100.0}),
    dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(min_p=1.0, top_p=1e-9),
])
def test_values_at_the_edges_of_their_ranges_are_accepted(kwargs):
    SamplingParams(**kwargs)
