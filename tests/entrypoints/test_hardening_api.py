"""Serving hardening, tried as an attacker and as an operator would, against real `pagedllm serve`
processes: hostile and oversized requests get a 4xx naming the problem (and leave a healthy server
without leaked KV blocks), CPU-heavy requests do not freeze /health, the waiting queue is bounded
(429), deadlines abort requests, SIGTERM drains, and the server exits when its engine core dies.

Three servers serve the module (each start costs seconds): `keyed` (auth, short HTTP timeouts),
`open_server` (no key, a queue bound of 2, a 2 s deadline; its core is killed last) and one
started and drained by the SIGTERM test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow  # a real server in a subprocess

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024
LONG_MODEL_LEN = 8192
"""The servers that run LONG (open_server, the drain test)."""
# Seconds of work on any machine (about 2 ms a token here): the deadline, drain and death tests need
# it still running when they act (1000 tokens once finished inside a 1-3 s window).
LONG = {"prompt": "Keep going", "max_tokens": 8000, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=LONG_MODEL_LEN)


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    srv = RemoteServer(model_dir, [
        "--api-key", KEY, "--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-body-bytes", "16MiB", "--timeout-request-header", "1", "--timeout-request-body", "1",
        "--allowed-origins", "https://ok.example", "--trust-request-chat-template",
    ], tmp_path_factory.mktemp("logs") / "keyed.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(model_dir, tmp_path_factory):
    srv = RemoteServer(model_dir, [
        "--num-kv-blocks", "640", "--max-model-len", str(LONG_MODEL_LEN), "--max-num-seqs", "1",
        "--max-num-waiting", "2", "--retry-after-s", "3", "--request-timeout", "2",
    ], tmp_path_factory.mktemp("logs") / "open.log")
    yield srv
    srv.stop()


def post(srv, path: str, body, headers=AUTH, content_type: str | None = "application/json",
         timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    if content_type is not None:
        headers = {"Content-Type": content_type, **headers}
    return httpx.post(f"{srv.url}{path}", content=content, headers=headers, timeout=timeout)


def assert_healthy(srv) -> None:
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, srv.log()


# (name, path, raw JSON body, status, words the message must hold)
HOSTILE = [
    ("lone surrogate in a prompt", "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "surrogate"),
    ("lone surrogate in a stop string", "/v1/completions",
     '{"prompt": "hi", "max_tokens": 2, "stop": ["x\\udfff"]}', 400, "surrogate"),
    ("lone surrogate in a chat message", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}', 400, "surrogate"),
    ("lone surrogate in /tokenize", "/tokenize", '{"prompt": "\\ud83d"}', 400, "surrogate"),
    ("max_tokens beyond 64 bits", "/v1/completions", '{"prompt": "hi", "max_tokens": 1180591620717411303424}',
     400, "64-bit"),
    ("a token id beyond 64 bits", "/v1/completions", '{"prompt": [1, 18446744073709551616], "max_tokens": 2}',
     400, "64-bit"),
    ("a seed beyond 64 bits", "/v1/completions", '{"prompt": "hi", "seed": -9223372036854775809}', 400, "64-bit"),
    ("NaN temperature", "/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "NaN"),
    ("Infinity top_p", "/v1/completions", '{"prompt": "hi", "top_p": -Infinity}', 400, "Infinity"),
    ("a temperature overflowing to infinity", "/v1/completions", '{"prompt": "hi", "temperature": 1e999}',
     400, "not finite"),
    ("an infinite logit bias", "/v1/completions", '{"prompt": "hi", "logit_bias": {"5": 1e400}}', 400, "finite"),
    ("tools", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}), 400, "--enable-auto-tool-choice"),
    ("tool_choice", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}), 400, "needs tools"),
    ("response_format with a malformed schema", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}),
     400, "invalid JSON schema"),
    ("chat min_tokens beyond the resolved max_tokens", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5000}), 400, "min_tokens"),
    # found by tests/entrypoints/test_fuzz_api.py (the outside audit's two, and the crash beside them)
    ("a chat message without content (OpenAI: 400)", "/v1/chat/completions",
     '{"messages": [{"role": "system"}], "max_tokens": 1}', 400, "messages.0.content"),
    ("min_tokens past a grammar's end (was a 500)", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "structured_outputs": {"choice": ["yes", "no"]},
        "min_tokens": 2}), 400, "min_tokens"),
    ("a length_penalty overflowing a beam's score (killed the engine)", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "use_beam_search": True,
        "length_penalty": 1e308}), 400, "length_penalty"),
    ("a length_penalty underflowing a beam's score (killed the engine)", "/v1/completions",
     '{"prompt": "hi", "max_tokens": 2, "use_beam_search": true, "length_penalty": -1e5}', 400, "length_penalty"),
    ("stream_options without stream (OpenAI: 400)", "/v1/completions",
     '{"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": true}}', 400, "stream_options"),
    ("JSON nested 100k deep", "/v1/completions", "[" * 100_000 + "]" * 100_000, 400, "nested"),
    ("a prompt longer than the context", "/v1/completions", json.dumps({"prompt": [1] * 2000}), 400,
     "max_model_len"),
    ("a token id outside the vocabulary", "/v1/completions", '{"prompt": [1, 49152]}', 400, "vocabulary"),
    ("a negative stop token id", "/v1/completions", '{"prompt": "hi", "stop_token_ids": [-1]}', 400, "stop_token_ids"),
    ("a logit_bias key that is no token id", "/v1/completions", '{"prompt": "hi", "logit_bias": {"a": 1}}',
     400, "logit_bias"),
    ("n beyond the limit", "/v1/completions", '{"prompt": "hi", "n": 100000}', 400, "n"),
    ("a wrongly typed field", "/v1/chat/completions", '{"messages": "hello"}', 400, "messages"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff"}', 400, "UTF-8"),
    ("a JSON array body", "/v1/completions", "[1, 2]", 400, "JSON object"),
    ("an empty body", "/v1/completions", "", 400, "empty"),
    ("an unknown model", "/v1/completions", '{"model": "gpt-9", "prompt": "hi"}', 404, "does not exist"),
    ("detokenize beyond 64 bits", "/detokenize", '{"tokens": [99999999999999999999999]}', 400, "64-bit"),
    # past Python's 4300-digit conversion limit: a ValueError inside the JSON parser, once a 500
    ("max_tokens of 5000 digits", "/v1/completions", '{"prompt": "hi", "max_tokens": 1' + "0" * 4999 + "}",
     400, "max_tokens: the integer (5000 digits) is out of the 64-bit range"),
    ("a chat max_tokens of 5000 digits", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -' + "9" * 5000 + "}", 400, "max_tokens"),
    ("a token id of 5000 digits", "/detokenize", '{"tokens": [1, ' + "7" * 5000 + "]}", 400, "tokens[1]"),
    ("a logit bias of 5000 digits", "/v1/completions", '{"prompt": "hi", "logit_bias": {"5": ' + "1" * 5000 + "}}",
     400, "logit_bias.5"),
    ("a temperature of 5000 digits", "/v1/completions", '{"prompt": "hi", "temperature": 1' + "0" * 5000 + ".5}",
     400, "temperature: the number is too large"),
    # a request's own chat template (this server trusts them): sandboxed and budgeted as the model's
    ("a chat template looping for minutes", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}),
     400, "ran past its render budget"),
    ("a chat template of a gigabyte", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": "{{ 'x' * 10**9 }}"}),
     400, "output exceeds"),
    ("a chat template reaching for globals", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template": "{{ cycler.__init__.__globals__.os.system('id') }}"}), 400, "unsafe"),
    ("chat_template_kwargs overriding an argument", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": {"tokenize": False}}),
     400, "may not set tokenize"),
]


@pytest.mark.parametrize("name,path,body,status,words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_a_clear_4xx(keyed, name, path, body, status, words):
    r = post(keyed, path, body)
    assert r.status_code == status, (name, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words.lower() in error["message"].lower(), (name, error)
    assert "Traceback" not in r.text and "/tmp" not in r.text
    assert_healthy(keyed)


@pytest.mark.parametrize("field,value", [
    ("temperature", 1e300), ("repetition_penalty", 1e-300), ("top_p", 1.5), ("presence_penalty", -1e300),
    ("top_k", -5), ("logprobs", 10**9), ("min_p", 5.0), ("frequency_penalty", 1e308),
])
def test_absurd_sampling_values_are_a_400_naming_the_field(keyed, field, value):
    """SamplingParams owns the ranges; the HTTP layer turns its refusal into a 400 naming the field."""
    r = post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field, r.text
    assert_healthy(keyed)


def test_a_trusted_request_template_renders(keyed):
    r = post(keyed, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    default = r.json()["tokens"]
    r = post(keyed, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                             "chat_template": "{{ greeting }}{{ messages[0].content }}",
                                             "chat_template_kwargs": {"greeting": "Hello "}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2 != len(default)  # "Hello", " hi"


def test_request_templates_need_the_flag(open_server):
    for field, value in (("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"x": 1})):
        r = post(open_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1, field: value}, headers={})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_no_blocks_leaked_after_hostile_requests(keyed):
    keyed.wait_idle_without_leaks()


def test_bodies_must_be_declared_json(keyed):
    """A cross-site page can send text/plain or a form without a preflight: such bodies are refused."""
    good = '{"prompt": "hi", "max_tokens": 1}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         None):
        r = post(keyed, "/v1/completions", good, content_type=content_type)
        assert r.status_code == 415, (content_type, r.text)
        assert "application/json" in r.json()["error"]["message"]
    assert post(keyed, "/v1/completions", good, content_type="application/json; charset=utf-8").status_code == 200
    assert post(keyed, "/tokenize", '{"prompt": "hi"}', content_type="text/plain").status_code == 415


def test_tokenize_needs_the_key_and_cors_is_closed_by_default(keyed):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert post(keyed, path, body, headers={}).status_code == 401
        assert post(keyed, path, body).status_code == 200
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{keyed.url}/v1/completions", headers=preflight, timeout=10)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    evil = httpx.options(f"{keyed.url}/v1/completions", headers={**preflight, "Origin": "https://evil.example"},
                         timeout=10)
    assert "access-control-allow-origin" not in evil.headers


def test_request_ids_are_echoed_and_models_shows_no_path(keyed, model_dir):
    r = post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={**AUTH, "X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    made = post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={**AUTH, "X-Request-Id": "a b"})
    assert made.headers["x-request-id"] and made.headers["x-request-id"] != "a b"  # not echoed as given
    models = httpx.get(f"{keyed.url}/v1/models", headers=AUTH, timeout=10)
    assert str(model_dir) not in models.text and "/" not in models.json()["data"][0]["root"]
    # with API keys (tenants isolated) cached_tokens tells a client only about its own prefixes
    usage = post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).json()["usage"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_partial_headers_and_stalled_bodies_are_cut(keyed):
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        started = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server, no response
        assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        started = time.monotonic()
        assert sock.recv(1024) == b""  # a connection that never sends anything
        assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
    assert_healthy(keyed)


def test_event_loop_stays_free_under_huge_prompts(keyed):
    """An 8 MB prompt on /tokenize and a 2 MB one on /v1/completions (both tokenized on worker
    threads) while /health is polled: every /health answers within a second, or within a tenth of the
    tokenizing time where a loaded machine stretches both (a blocked event loop would answer only after it)."""
    big = ("The quick brown fox jumps over the lazy dog. " * 200_000)[: 8 * 2**20]
    results: dict[str, httpx.Response] = {}

    def send(name: str, path: str, body: dict) -> None:
        results[name] = post(keyed, path, body, timeout=300)

    threads = [threading.Thread(target=send, args=("tokenize", "/tokenize", {"prompt": big})),
               threading.Thread(target=send, args=("completion", "/v1/completions",
                                                   {"prompt": big[: 2 * 2**20], "max_tokens": 1}))]
    for t in threads:
        t.start()
    time.sleep(1.0)  # both bodies are in and being tokenized
    worst = 0.0
    busy_since = time.monotonic() - 1.0
    with httpx.Client(timeout=10) as client:
        while any(t.is_alive() for t in threads):
            started = time.monotonic()
            assert client.get(f"{keyed.url}/health").status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.05)
    busy = time.monotonic() - busy_since
    for t in threads:
        t.join()
    assert results["tokenize"].status_code == 200 and results["tokenize"].json()["count"] > 1_000_000
    assert results["completion"].status_code == 400 and "max_model_len" in results["completion"].text
    assert worst < max(1.0, busy / 10), f"/health took {worst:.2f} s while huge prompts were tokenized for {busy:.1f} s"


def test_cached_tokens_are_hidden_without_keys(open_server):
    usage = post(open_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={}).json()["usage"]
    assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] > 0


def test_the_dashboard_is_off_by_default(open_server):
    """No --enable-dashboard: neither the page nor its event stream exists (test_dashboard.py covers it on)."""
    assert httpx.get(f"{open_server.url}/dashboard", timeout=10).status_code == 404
    assert httpx.get(f"{open_server.url}/dashboard/events", timeout=10).status_code == 404


def test_waiting_requests_are_bounded_with_429(open_server, model_dir):
    """max_num_seqs 1 and a bound of 2 waiting: one runs, two wait, the next is told to retry."""
    url = open_server.url
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(post(open_server, "/v1/completions", LONG, headers={}, timeout=30))

    threads = [threading.Thread(target=send) for _ in range(3)]
    threads[0].start()
    time.sleep(0.5)  # running
    threads[1].start()
    threads[2].start()
    time.sleep(0.3)  # waiting
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model_dir.name, prompt="hi", max_tokens=2)
    assert info.value.response.headers["retry-after"] == "3"
    error = info.value.response.json()["error"]
    assert error["type"] == "overloaded" and error["code"] == "overloaded" and "retry" in error["message"]
    for t in threads:
        t.join()
    open_server.wait_idle_without_leaks()
    assert open_server.metrics()["pagedllm_requests_rejected_total"] >= 1


def test_the_deadline_aborts_and_says_why(open_server):
    """--request-timeout 2: an 8000-token request is aborted (blocks freed); a plain request gets a
    504, a stream an error event, then [DONE]."""
    started = time.monotonic()
    r = post(open_server, "/v1/completions", LONG, headers={}, timeout=30)
    assert r.status_code == 504 and "request timeout of 2 s" in r.json()["error"]["message"]
    assert time.monotonic() - started < 6
    with httpx.stream("POST", f"{open_server.url}/v1/completions", json={**LONG, "stream": True},
                      timeout=30) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert '"request_timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
    open_server.wait_idle_without_leaks()


def test_engine_death_exits_the_server(open_server):
    """Without --keep-alive-on-engine-death, a dead core makes the server exit non-zero (a supervisor
    restarts it); the stream in flight still ends with an error event and [DONE]."""
    with httpx.stream("POST", f"{open_server.url}/v1/completions", json={**LONG, "stream": True},
                      timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        os.kill(open_server.core_pid(), signal.SIGKILL)
        rest = "\n".join(lines)
    assert '"engine_dead"' in rest and rest.rstrip().endswith("data: [DONE]")
    assert open_server.proc.wait(15) == 1


def test_sigterm_drains(model_dir, tmp_path_factory):
    """SIGTERM: /health and new requests get 503 at once, a short request in flight finishes, a long
    stream is ended at --shutdown-timeout with an error event and [DONE], and the server exits 0."""
    srv = RemoteServer(model_dir, ["--num-kv-blocks", "640", "--max-model-len", str(LONG_MODEL_LEN),
                                   "--shutdown-timeout", "3"], tmp_path_factory.mktemp("logs") / "drain.log")
    try:
        results: dict[str, object] = {}
        long_started = threading.Event()

        def stream_long() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "stream": True},
                              timeout=30) as stream:
                lines = []
                for line in stream.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        long_started.set()
                results["long"] = lines

        short_started = threading.Event()

        def stream_short() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30, json={
                    "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}) as stream:
                lines = []
                for line in stream.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        short_started.set()
                results["short"] = lines

        long_thread = threading.Thread(target=stream_long)
        long_thread.start()
        short_thread = threading.Thread(target=stream_short)
        short_thread.start()
        # both must be in flight before the signal: were the long one not yet connected, the short
        # one could finish, the drain end and the server be gone before /health is asked
        assert short_started.wait(20) and long_started.wait(20)
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
        refused = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={}, timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        short_thread.join(30)
        long_thread.join(30)
        short_lines = results["short"]  # finished in full: no error event
        assert short_lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in short_lines[-2]
        long_lines = results["long"]
        assert len(long_lines) > 3 and '"server_shutting_down"' in long_lines[-2] and long_lines[-1] == "data: [DONE]"
        assert srv.proc.wait(20) == 0
        assert 2.5 < time.monotonic() - signalled < 15
    finally:
        srv.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    srv = RemoteServer(model_dir, ["--num-kv-blocks", "32", "--max-model-len", "256", "--ssl-keyfile", str(key),
                                   "--ssl-certfile", str(cert)], tmp_path / "tls.log")
    try:
        assert srv.url.startswith("https://")
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, verify=ssl.create_default_context(cafile=str(cert)),
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not spoken there
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5).raise_for_status()
    finally:
        assert srv.stop() == 0
