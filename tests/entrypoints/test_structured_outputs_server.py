"""Structured outputs through a real `pagedllm serve` of the embedded SmolLM2 and the official `openai`
client: OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs field (json,
regex, choice, grammar) on both endpoints, streamed and not; every sample at temperature 1.0
validates; malformed schemas and regexes are 400s naming the problem; the metrics count it all."""

from __future__ import annotations

import functools
import json
import re

import httpx
import jsonschema
import openai
import pytest

from pagedllm.model.loader import resolve_hf_dir
from tests.entrypoints.server_helpers import RemoteServer, concurrently
from tests.entrypoints.test_structured_outputs_offline import CHOICES, PERSON, PHONE, RATING, TAGS

pytestmark = pytest.mark.slow  # a real server in a subprocess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer(resolve_hf_dir(None), ["--max-model-len", "512", "--served-model-name", "smol"],
                       tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _validate_all(choices, text_of, schema) -> None:
    for choice in choices:
        assert choice.finish_reason == "stop", (text_of(choice), choice.finish_reason)
        jsonschema.validate(json.loads(text_of(choice)), schema)


def test_chat_response_format_json_schema(client):
    cases = [(schema, seed) for schema in (PERSON, RATING) for seed in (0, 1)]
    ask = [{"role": "user", "content": "Give me an example record."}]
    responses = concurrently(*[functools.partial(client.chat.completions.create, model="smol", messages=ask, n=8,
                                                 seed=seed, temperature=1.0, max_tokens=96,
                                                 response_format=_schema_format(schema))
                               for schema, seed in cases])
    for schema in (PERSON, RATING):
        texts = set()
        for (case_schema, _), r in zip(cases, responses):
            if case_schema is schema:
                _validate_all(r.choices, lambda c: c.message.content, schema)
                texts.update(c.message.content for c in r.choices)
        assert len(texts) > 4


def test_chat_json_object_and_streaming(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Any JSON object."}],
                                       n=4, seed=2, max_tokens=96, response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":  # an unconstrained object may be long: validate those that closed
            assert isinstance(json.loads(c.message.content), dict)
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Tags?"}], seed=3,
                                            max_tokens=96, response_format=_schema_format(TAGS), stream=True)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), TAGS)


def test_completions_structured_outputs_field(client):
    r = client.completions.create(model="smol", prompt="A tagged item as JSON:", n=8, seed=4, max_tokens=96,
                                  extra_body={"structured_outputs": {"json": TAGS}})
    _validate_all(r.choices, lambda c: c.text, TAGS)
    r = client.completions.create(model="smol", prompt="Call me at", n=8, seed=5, max_tokens=24,
                                  extra_body={"structured_outputs": {"regex": PHONE}})
    assert all(re.fullmatch(PHONE, c.text) and c.finish_reason == "stop" for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model="smol", prompt="Sentiment of 'I loved it':", n=8, seed=6, max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.text in CHOICES for c in r.choices), [c.text for c in r.choices]
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "yes or no?"}], n=4,
                                       max_tokens=8, extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert all(c.message.content in ("yes", "no") for c in r.choices)


def test_seeded_requests_are_reproducible(client):
    def ask():
        r = client.completions.create(model="smol", prompt="Rate it:", n=4, seed=7, max_tokens=96,
                                      extra_body={"structured_outputs": {"json": RATING}})
        return [c.text for c in r.choices]

    first = ask()
    assert ask() == first


@pytest.mark.parametrize("path,body,words", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": _schema_format({"type": "objectx"})}, "invalid JSON schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "schema"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, "invalid regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "{oops"}}, "invalid JSON schema"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
                              "structured_outputs": {"regex": "a"}}, "not both"),
])
def test_invalid_constraints_are_400s_naming_the_problem(server, path, body, words):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()


def test_openai_client_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client.completions.create(model="smol", prompt="x", extra_body={"structured_outputs": {"regex": "[a-"}})


def test_metrics_count_structured_requests_and_cache_hits(server, client):
    before = server.metrics()
    for _ in range(2):
        client.completions.create(model="smol", prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["metric-a", "metric-b"]}})
    after = server.wait_idle_without_leaks()
    assert after["pagedllm_structured_output_requests_total"] - before.get("pagedllm_structured_output_requests_total", 0) == 2
    assert after["pagedllm_grammar_cache_hits_total"] - before.get("pagedllm_grammar_cache_hits_total", 0) >= 1
    assert after["pagedllm_grammar_cache_misses_total"] >= 1
