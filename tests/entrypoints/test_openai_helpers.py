"""Server helpers without a server: error mapping, API-key matching, tenant salts, request models."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from pagedllm.engine.async_llm import EngineStoppingError, RequestFailedError, RequestStream, RequestTimeoutError
from pagedllm.entrypoints.openai.auth import find_api_key, tenant_cache_salt
from pagedllm.entrypoints.openai.errors import APIError, api_error_from, current_request_id
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.http_intake import parse_model
from pagedllm.errors import EngineDeadError, InvalidRequestError
from pagedllm.outputs import CompletionOutput, RequestOutput


def _request_with(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw})


def test_errors_map_to_openai_statuses():
    assert api_error_from(InvalidRequestError("temperature must be >= 0")).status == 400
    assert api_error_from(InvalidRequestError("temperature must be >= 0")).param == "temperature"
    assert api_error_from(EngineDeadError("gone")).status == 503
    token = current_request_id.set("req-42")
    try:
        failed = api_error_from(RequestFailedError("sampler blew up at /home/me/model"))
    finally:
        current_request_id.reset(token)
    # a 500 names the request id only: exception text (paths, internals) stays in the log
    assert failed.status == 500 and "req-42" in failed.message and "blew up" not in failed.message
    assert api_error_from(RequestTimeoutError("too slow")).status == 504
    assert api_error_from(EngineStoppingError("bye")).status == 503
    assert set(APIError(404, "x").body()["error"]) == {"message", "type", "param", "code"}


def test_a_sequence_that_failed_alone_fails_its_stream_and_is_a_500_hiding_its_error(caplog):
    ok = CompletionOutput(0, "fine", [1], None, None, None)
    failed = CompletionOutput(1, "", [], None, None, "abort", error="NaN logits")
    released = []

    async def read() -> list:
        stream = RequestStream("r", released.append)
        stream.put(RequestOutput("r", "p", [1], [ok], False))
        stream.put(RequestOutput("r", "p", [1], [ok, failed], True))
        seen = []
        with pytest.raises(RequestFailedError) as info:
            async for output in stream:
                seen.append(output)
        return seen, info.value

    seen, error = asyncio.run(read())
    assert len(seen) == 1 and released == [released[0]] and "NaN logits" in str(error)  # closed once: aborted
    mapped = api_error_from(error)
    assert mapped.status == 500 and "NaN logits" not in mapped.message
    assert "NaN logits" in caplog.text


def test_api_key_matching():
    keys = ("alpha", "beta")
    assert find_api_key(_request_with({"Authorization": "Bearer beta"}), keys) == "beta"
    assert find_api_key(_request_with({"Authorization": "bearer alpha"}), keys) == "alpha"
    for header in ({}, {"Authorization": "Bearer gamma"}, {"Authorization": "Basic alpha"},
                   {"Authorization": "Bearer "}, {"Authorization": "Bearer alph"}):
        assert find_api_key(_request_with(header), keys) is None


def test_tenant_salts_isolate_keys_unless_shared():
    a, b = tenant_cache_salt("alpha", None, False), tenant_cache_salt("beta", None, False)
    assert a != b and "alpha" not in a
    assert tenant_cache_salt("alpha", "s", False) not in (a, "s")
    assert tenant_cache_salt("alpha", "s", False) != tenant_cache_salt("beta", "s", False)
    assert tenant_cache_salt("alpha", None, True) is None
    assert tenant_cache_salt("alpha", "s", True) == "s"
    assert tenant_cache_salt(None, "s", False) == "s"


def test_request_models_validate_and_convert():
    req = parse_model(CompletionRequest, {"prompt": [[1, 2], [3]], "logit_bias": {"5": 2}, "top_k": -1, "n": 2})
    params = req.to_sampling_params()
    assert req.prompts() == [[1, 2], [3]] and params.logit_bias == {5: 2.0} and params.top_k is None
    chat = parse_model(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 5,
        "max_tokens": 9, "logprobs": True, "top_logprobs": 2})
    assert chat.messages[0].text() == "ab"
    chat_params = chat.to_sampling_params()
    assert chat_params.max_tokens == 5 and chat_params.logprobs == 2
    with pytest.raises(APIError) as info:
        parse_model(CompletionRequest, {"prompt": "x", "n": "lots"})
    assert info.value.status == 400 and info.value.param == "n"
    with pytest.raises(InvalidRequestError, match="best_of"):
        parse_model(CompletionRequest, {"prompt": "x", "best_of": 3, "stream": True}).to_sampling_params()


USER = {"role": "user", "content": "hi"}
# (name, messages, the field named): each refused by OpenAI's Chat Completions API with a 400 (its OpenAPI spec)
REFUSED_MESSAGES = [
    ("user without content (the audit's 200)", [{"role": "user"}], "messages.0.content"),
    ("system with null content", [{"role": "system", "content": None}], "messages.0.content"),
    ("developer without content", [{"role": "developer"}], "messages.0.content"),
    ("assistant without content or tool_calls", [USER, {"role": "assistant"}], "messages.1.content"),
    ("an empty list of parts", [{"role": "user", "content": []}], "messages.0.content"),
    ("a text part without text", [{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
    ("an image in a system message", [{"role": "system", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages.0.content.0.type"),
    ("a refusal part from the user", [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}],
     "messages.0.content.0.type"),
    ("a tool message without tool_call_id", [USER, {"role": "tool", "content": "42"}], "messages.1.tool_call_id"),
    ("a tool message answering no tool_calls", [USER, {"role": "tool", "content": "42", "tool_call_id": "c"}],
     "messages.1.role"),
    ("a function message without name", [USER, {"role": "function", "content": "42"}], "messages.1.name"),
    ("a function message without content", [USER, {"role": "function", "name": "f"}], "messages.1.content"),
    ("an empty tool_calls list", [USER, {"role": "assistant", "content": "x", "tool_calls": []}],
     "messages.1.tool_calls"),
    ("a name that is no string", [{"role": "user", "content": "hi", "name": 5}], "messages.0.name"),
    ("an unknown role", [{"role": "wizard", "content": "hi"}], "messages.0.role"),
]
# accepted by OpenAI, but this server cannot serve them: a 400 saying so
UNSERVED_MESSAGES = [
    ("an image", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
     "messages.0.content.0.type", "not supported"),
    ("function_call", [USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": ""}}],
     "messages.1.function_call", "use tools"),
    ("a function message", [USER, {"role": "function", "name": "f", "content": None}], "messages.1.role",
     "use tools"),
]


@pytest.mark.parametrize("name,messages,param", REFUSED_MESSAGES, ids=[m[0] for m in REFUSED_MESSAGES])
def test_chat_messages_follow_openai_rules(name, messages, param):
    with pytest.raises(APIError) as info:
        parse_model(ChatCompletionRequest, {"messages": messages})
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert info.value.message.startswith(f"{param}: "), info.value.message


@pytest.mark.parametrize("name,messages,param,words", UNSERVED_MESSAGES, ids=[m[0] for m in UNSERVED_MESSAGES])
def test_chat_messages_this_server_cannot_serve_are_refused_clearly(name, messages, param, words):
    with pytest.raises(APIError) as info:
        parse_model(ChatCompletionRequest, {"messages": messages})
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


@pytest.mark.parametrize("body,param,words", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "str or list[ContentPart]"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0.type", "Field required"),
    ({"messages": [USER], "stop": 5}, "stop", "str or list[str]"),
])
def test_a_field_of_several_types_is_named_without_the_type_names(body, param, words):
    """pydantic fails once per type (`content.str`, `content.list[ContentPart].0.type`): the 400 names
    the field as the client wrote it, and the types when the value matched none."""
    with pytest.raises(APIError) as info:
        parse_model(ChatCompletionRequest, body)
    assert info.value.param == param and words in info.value.message and "more problems" not in info.value.message


def test_chat_messages_openai_accepts_are_read_as_text():
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "", "name": "ann"},
                {"role": "assistant", "content": [{"type": "text", "text": "I "}, {"type": "refusal", "refusal": "won't"}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    request = parse_model(ChatCompletionRequest, {"messages": messages})
    assert [m.text() for m in request.messages] == ["Be brief.", "", "I won't", "ab"]


@pytest.mark.parametrize("extra,field", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # OpenAI: only allowed when stream is true
    ({"min_tokens": 2, "structured_outputs": {"choice": ["yes"]}}, "min_tokens"),  # the audit's 500
    ({"min_tokens": 1, "response_format": {"type": "json_object"}}, "min_tokens"),
    ({"use_beam_search": True, "length_penalty": 1e308}, "length_penalty"),  # killed the engine core
    ({"use_beam_search": True, "length_penalty": -1e5}, "length_penalty"),
])
def test_fields_the_fuzzer_broke_are_a_400_naming_them(extra, field):
    for model, base in ((ChatCompletionRequest, {"messages": [USER]}), (CompletionRequest, {"prompt": "hi"})):
        with pytest.raises((APIError, InvalidRequestError)) as info:
            parse_model(model, {**base, **extra}).to_sampling_params()
        error = api_error_from(info.value)
        assert error.status == 400 and error.param == field, error.message
    assert parse_model(CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True},
                                           "use_beam_search": True, "length_penalty": -10}).to_sampling_params()


def test_strict_json_bodies():
    from pagedllm.entrypoints.openai.http_intake import parse_json_body

    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00", "ids": [1, 2]}') == {"prompt": "\U0001F600", "ids": [1, 2]}
    for body, words in ((b'{"t": NaN}', "NaN"), (b'{"t": [1e999]}', "not finite"), (b'{"x": {"y": 2e400}}', "x.y"),
                        (b'{"ids": [1, 9223372036854775808]}', "64-bit"), (b'{"s": -9223372036854775809}', "64-bit"),
                        (b'{"p": ["ok", "\\udc00"]}', "p[1]"), (b'{"\\ud800": 1}', "surrogate"),
                        (b"[" * 50_000 + b"]" * 50_000, "nested"), (b"  ", "empty"), (b"\xff", "UTF-8")):
        with pytest.raises(APIError) as info:
            parse_json_body(body)
        assert info.value.status == 400 and words in info.value.message, (body[:40], info.value.message)
    assert parse_json_body(b'{"s": 9223372036854775807, "f": 1e308}')["s"] == 2**63 - 1


def test_deprecated_functions_are_refused_naming_tools():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for extra in ({"functions": [{"name": "f"}]}, {"function_call": "auto"}):
        with pytest.raises(APIError) as info:
            parse_model(ChatCompletionRequest, {**base, **extra})
        assert info.value.status == 400 and "use tools" in info.value.message
    # asking for nothing is fine
    request = parse_model(ChatCompletionRequest, {**base, "tools": [], "tool_choice": "none",
                                                  "response_format": {"type": "text"}})
    assert request.to_sampling_params().structured_outputs is None
    with pytest.raises(APIError):  # response_format types are OpenAI's three
        parse_model(CompletionRequest, {"prompt": "x", "response_format": {"type": "xml"}})


def test_cached_tokens_are_reported_only_where_they_leak_nothing():
    from pagedllm.entrypoints.openai.cli_args import ServerConfig
    from pagedllm.entrypoints.openai.serving import ServingContext

    def reported(**config) -> bool:
        ctx = ServingContext(engine=None, served_model_names=["m"], config=ServerConfig(**config))
        return "prompt_tokens_details" in ctx.usage(3, 1, 2)

    assert not reported()  # no keys: anyone could probe anyone's prefixes
    assert reported(api_keys=("k",))  # tenants isolated: only their own
    assert not reported(api_keys=("k",), share_prefix_cache_across_keys=True)
    assert reported(enable_prompt_tokens_details=True)


def test_server_config_validates_its_limits():
    from pagedllm.entrypoints.openai.cli_args import ServerConfig

    for bad in ({"max_num_waiting": -1}, {"shutdown_timeout": 0}, {"ssl_keyfile": "k.pem"},
                {"num_frontend_threads": 0}, {"timeout_request_header": -1}, {"allowed_origins": ("",)}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_an_unhandled_error_is_a_500_naming_only_the_request_id(caplog):
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from pagedllm.entrypoints.openai.http_intake import RequestIdMiddleware

    app = FastAPI()

    @app.get("/x")
    async def broken():
        raise RuntimeError("secret at /home/me/models/llama")

    app.add_middleware(RequestIdMiddleware)  # as build_app does
    r = TestClient(app, raise_server_exceptions=False).get("/x", headers={"X-Request-Id": "rid-7"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "rid-7"
    assert "rid-7" in r.json()["error"]["message"] and "secret" not in r.text and "/home" not in r.text
    assert "secret at /home/me/models/llama" in caplog.text
