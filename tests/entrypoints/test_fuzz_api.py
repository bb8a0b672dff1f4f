"""Property-based fuzzing of the OpenAI-compatible API as an attacker would do it: bodies drawn from
the server's own request schemas (the pydantic models' JSON schemas) and sent over real HTTP to a
real `pagedllm serve` (tiny random Llama), and chat messages drawn from every shape OpenAI's
Chat Completions API knows, judged against OpenAI's own rules.

Properties:
- no body ever gets a 5xx, and the server stays up (a 5xx or a dead engine fails the example);
- every 4xx is an OpenAI-style JSON error that names a field of the request;
- a message list OpenAI's API refuses with a 400 is refused here too, naming that message's field.

A body is a valid base for one scenario (plain, streaming, beam search, structured outputs,
logprobs, several sequences) with some of the fields that scenario exercises drawn from the schema,
numbers biased to their edges, plus now and then one field of any kind, of any JSON type. The
examples are derandomized (the same on every run) and bounded so the module runs in seconds; raise
`max_examples` locally to search harder.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
    srv = RemoteServer(model_dir, ["--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN)],
                       tmp_path_factory.mktemp("logs") / "fuzz.log")
    yield srv
    srv.stop()


# ---- values: what the schema allows, biased to the edges where code breaks ----

EDGE_INTS = [-2**63, -1, 0, 1, 2, 3, 5, 20, 21, 64, 65, MAX_MODEL_LEN, 2**31, 2**63 - 1]
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 1e-300, 5e-324, 100.0, -100.0, 1e300, -1e300, 1e308, -1e308]
# Grammars that accept nothing ("root ::= root") have their own test: test_a_grammar_that_accepts_no_output_is_a_400.
EDGE_STRINGS = ["", " ", "a", "hi", "none", "auto", "text", "never", "json_object", "{}", "0", "é", "\x00",
                'root ::= "a"', 'root ::= "a" root', "(", "[ab]{1,3}"]


class RawNumber:
    """A number literal sent as written: past 64 bits, past Python's 4300-digit conversion limit, or overflowing a
    float (json.dumps cannot write the longest ones)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text if len(self.text) < 40 else f"<{len(self.text)}-character number>"


RAW_NUMBERS = [RawNumber(t) for t in ("18446744073709551616", "-9223372036854775809", "1" + "0" * 4999,
                                      "-" + "9" * 5000, "1e400", "-1e99999", "1" + "0" * 5000 + ".5",
                                      "0." + "0" * 5000 + "1")]
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-2, 8), st.sampled_from(RAW_NUMBERS))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(-3, 3), st.sampled_from(RAW_NUMBERS))
strings = st.one_of(st.sampled_from(EDGE_STRINGS), st.text(max_size=6))
any_json = st.recursive(st.none() | st.booleans() | ints | floats | strings,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
                        max_leaves=6)


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values for a JSON schema (the subset pydantic emits), with its bounds and one step past them."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    kind = schema.get("type")
    bounds = [schema[k] + d for k in ("minimum", "maximum") if k in schema for d in (-1, 0, 1)]
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.one_of(ints, st.sampled_from([int(b) for b in bounds])) if bounds else ints
    if kind == "number":
        return st.one_of(floats, st.sampled_from([float(b) for b in bounds])) if bounds else floats
    if kind == "string":
        longest = schema.get("maxLength")
        return st.one_of(strings, st.just("x" * (longest + 1))) if longest else strings
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), max_size=3)
    if kind == "object":
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties", {})
            values = from_schema(extra, defs) if isinstance(extra, dict) else any_json
            return st.dictionaries(st.one_of(st.integers(-1, 49200).map(str), strings), values, max_size=3)
        required = set(schema.get("required", []))
        return st.fixed_dictionaries({k: from_schema(v, defs) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v, defs) for k, v in props.items() if k not in required})
    return any_json


USER = {"role": "user", "content": "hi"}
# (scenario, valid base body, the fields it exercises)
CHAT_SCENARIOS = [
    ("plain", {"messages": [USER], "max_tokens": 4}, None),
    ("stream", {"messages": [USER], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
     ["n", "logprobs", "top_logprobs", "stop", "include_stop_str_in_output", "max_tokens", "stream_options"]),
    ("beam search", {"messages": [USER], "max_tokens": 4, "use_beam_search": True, "n": 2},
     ["length_penalty", "early_stopping", "n", "max_tokens", "logprobs", "top_logprobs", "stream", "temperature"]),
    ("structured", {"messages": [USER], "max_tokens": 6, "structured_outputs": {"choice": ["yes", "no"]}},
     ["min_tokens", "max_tokens", "ignore_eos", "stop", "stop_token_ids", "logit_bias", "n", "logprobs",
      "structured_outputs", "response_format", "use_beam_search"]),
    ("logprobs", {"messages": [USER], "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
     ["top_logprobs", "logprobs", "n", "temperature", "seed", "logit_bias"]),
    ("several", {"messages": [USER], "max_tokens": 3, "n": 3, "seed": 7},
     ["n", "seed", "temperature", "top_p", "top_k", "min_p", "max_completion_tokens", "presence_penalty"]),
]
COMPLETION_SCENARIOS = [
    ("plain", {"prompt": "hi", "max_tokens": 4}, None),
    ("token ids", {"prompt": [[1, 2], [3]], "max_tokens": 3}, ["prompt", "echo", "logprobs", "max_tokens"]),
    ("stream", {"prompt": "hi", "max_tokens": 4, "stream": True},
     ["n", "best_of", "logprobs", "echo", "stop", "stream_options", "include_stop_str_in_output"]),
    ("beam search", {"prompt": "hi", "max_tokens": 4, "use_beam_search": True, "n": 2},
     ["length_penalty", "early_stopping", "n", "best_of", "max_tokens", "logprobs", "echo", "stream"]),
    ("structured", {"prompt": "hi", "max_tokens": 6, "structured_outputs": {"regex": "[ab]{1,3}"}},
     ["min_tokens", "max_tokens", "ignore_eos", "stop", "stop_token_ids", "logit_bias", "best_of", "echo",
      "structured_outputs", "response_format"]),
    ("echo", {"prompt": "hi there", "max_tokens": 2, "echo": True, "logprobs": 2},
     ["logprobs", "echo", "max_tokens", "n", "best_of", "prompt"]),
]


@st.composite
def bodies(draw, model, scenarios):
    schema = model.model_json_schema()
    props, defs = schema["properties"], schema.get("$defs", {})
    _, base, fields = draw(st.sampled_from(scenarios))
    chosen = draw(st.lists(st.sampled_from(fields or sorted(props)), max_size=3, unique=True))
    body = dict(base)
    for field in chosen:
        body[field] = draw(from_schema(props[field], defs))
    if draw(st.integers(0, 3)) == 0:  # now and then, one field of any kind and any JSON type
        field = draw(st.sampled_from(sorted(props)))
        body[field] = draw(st.one_of(from_schema(props[field], defs), any_json))
    return body


# ---- the properties ----

def encode(body) -> str:
    """``body`` as JSON, each RawNumber written as its literal."""
    raw = []

    def placeholder(value):
        if not isinstance(value, RawNumber):
            raise TypeError(type(value).__name__)
        raw.append(value.text)
        return f"\x00raw{len(raw) - 1}\x00"

    text = json.dumps(body, default=placeholder)
    return re.sub(r'"\\u0000raw(\d+)\\u0000"', lambda m: raw[int(m.group(1))], text)


def send(server, path: str, body: dict) -> httpx.Response:
    try:
        return httpx.post(f"{server.url}{path}", content=encode(body), timeout=60,
                          headers={"Content-Type": "application/json"})
    except httpx.TransportError as e:  # the server (or its engine) went away
        raise AssertionError(f"the server stopped answering: {e!r}\n{server.log()}") from None


def check_answer(server, path: str, body: dict, response: httpx.Response) -> None:
    """No 5xx; a 4xx is a JSON error naming a field of the request."""
    assert response.status_code < 500, f"{response.status_code} for {encode(body)[:2000]}: {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text
        fields = set(body) | set(_schema_fields(path))
        named = error["param"] is not None and error["param"].split(".")[0] in fields
        assert named or any(re.search(rf"\b{f}\b", error["message"]) for f in fields), \
            f"{response.status_code} names no field for {encode(body)[:2000]}: {error}"


MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def _schema_fields(path: str) -> list[str]:
    return list(MODELS[path].model_json_schema()["properties"])


def assert_up(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, server.log()


@FUZZ
@given(body=bodies(ChatCompletionRequest, CHAT_SCENARIOS))
def test_fuzz_chat_bodies(server, body):
    check_answer(server, "/v1/chat/completions", body, send(server, "/v1/chat/completions", body))


@FUZZ
@given(body=bodies(CompletionRequest, COMPLETION_SCENARIOS))
def test_fuzz_completion_bodies(server, body):
    check_answer(server, "/v1/completions", body, send(server, "/v1/completions", body))


@settings(FUZZ, max_examples=40)
@given(case=st.one_of(
    st.tuples(st.just("/tokenize"), bodies(TokenizeRequest, [("prompt", {"prompt": "hi"}, None),
                                                             ("messages", {"messages": [USER]}, None)])),
    st.tuples(st.just("/detokenize"), bodies(DetokenizeRequest, [("ids", {"tokens": [1, 2]}, None)]))))
def test_fuzz_tokenizer_bodies(server, case):
    path, body = case
    check_answer(server, path, body, send(server, path, body))


# ---- chat messages against OpenAI's rules ----

ROLES = ["system", "developer", "user", "assistant", "tool", "function", "wizard"]
PARTS = {
    "text": {"type": "text", "text": "hi"}, "text without text": {"type": "text"},
    "text of a number": {"type": "text", "text": 5},
    "image_url": {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "file": {"type": "file", "file": {"file_id": "file-1"}},
    "refusal": {"type": "refusal", "refusal": "no"}, "refusal without refusal": {"type": "refusal"},
    "unknown": {"type": "video"},
}
OPENAI_PART_TYPES = {"system": {"text"}, "developer": {"text"}, "tool": {"text"},
                     "user": {"text", "image_url", "input_audio", "file"}, "assistant": {"text", "refusal"}}
ABSENT = object()
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@st.composite
def messages(draw):
    """A message of any role, with each field absent, null, well-formed or malformed."""
    message = {"role": draw(st.sampled_from(ROLES))}
    options = {
        "content": [ABSENT, None, "", "hi", 5, [],
                    st.lists(st.sampled_from(sorted(PARTS)).map(PARTS.get), min_size=1, max_size=2)],
        "name": [ABSENT, "bob", 5],
        "tool_call_id": [ABSENT, "call_1", 5],
        "tool_calls": [ABSENT, [], [TOOL_CALL]],
        "function_call": [ABSENT, {"name": "f", "arguments": "{}"}],
    }
    for key, choices in options.items():
        choice = draw(st.sampled_from(choices))
        value = draw(choice) if isinstance(choice, st.SearchStrategy) else choice
        if value is not ABSENT:
            message[key] = value
    return message


def openai_refusal(msgs: list[dict]) -> tuple[int, str] | None:
    """(message index, field) of the first rule OpenAI's Chat Completions API refuses with a 400, or None.

    From its OpenAPI spec: per-role content (required except for an assistant with tool_calls or
    function_call; a string or a non-empty list of the part types each role allows, each part with
    its text), a string name, tool messages with a tool_call_id, function messages with a name, and
    a tool message only in answer to an assistant's tool_calls."""
    called = False
    for i, m in enumerate(msgs):
        role = m["role"]
        if role not in OPENAI_PART_TYPES and role != "function":
            return i, "role"
        if "name" in m and not isinstance(m["name"], str):
            return i, "name"
        content = m.get("content", ABSENT)
        if role == "function":
            if content is ABSENT or not (content is None or isinstance(content, str)):
                return i, "content"
            if not isinstance(m.get("name"), str):
                return i, "name"
            continue
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            return i, "tool_call_id"
        if role == "assistant" and m.get("tool_calls") == []:
            return i, "tool_calls"
        if content is ABSENT or content is None:
            if role != "assistant" or not (m.get("tool_calls") or "function_call" in m):
                return i, "content"
        elif isinstance(content, list):
            if not content:
                return i, "content"
            for part in content:
                if part["type"] not in OPENAI_PART_TYPES[role]:
                    return i, "content"
                if part["type"] in ("text", "refusal") and not isinstance(part.get(part["type"]), str):
                    return i, "content"
        elif not isinstance(content, str):
            return i, "content"
        if role == "tool" and not called:
            return i, "role"  # "messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
        called = called or bool(role == "assistant" and m.get("tool_calls"))
    return None


@settings(FUZZ, max_examples=80)
@given(msgs=st.lists(messages(), min_size=1, max_size=3))
def test_chat_messages_follow_openai_rules(server, msgs):
    body = {"messages": msgs, "max_tokens": 1}
    response = send(server, "/v1/chat/completions", body)
    check_answer(server, "/v1/chat/completions", body, response)
    refused = openai_refusal(msgs)
    if refused is not None:
        index, _ = refused
        assert response.status_code == 400, f"OpenAI refuses message {index} of {json.dumps(msgs)}: " \
                                            f"{response.status_code} {response.text[:300]}"
        assert (response.json()["error"]["param"] or "").startswith("messages"), response.text


@pytest.mark.parametrize("spec", [{"grammar": "root ::= root"}, {"grammar": 'root ::= x\nx ::= x "a"'},
                                  {"regex": "[^\\s\\S]"}, {"json": {"type": "string", "pattern": "[^\\s\\S]"}}])
def test_a_grammar_that_accepts_no_output_is_a_400(server, spec):
    """Found by hand beside the fuzzing: no first token was allowed, a 500; now refused where grammars are built."""
    body = {"prompt": "hi", "max_tokens": 4, "structured_outputs": spec}
    response = send(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert "accepts no output" in response.json()["error"]["message"]


def test_server_survived_the_fuzzing(server):
    assert_up(server)
    server.wait_idle_without_leaks()
