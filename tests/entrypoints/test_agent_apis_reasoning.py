"""Reasoning through the Responses and Messages APIs, end to end: a real `pagedllm serve` of a tiny random
Llama with `--reasoning-parser deepseek_r1` (its template opened <think>, so the output is reasoning up to a
</think>). The split the chat path makes (reasoning_content, content) is the reference: the same greedy
conversation must give a Responses `reasoning` item and an Anthropic `thinking` block with exactly that
text, whole and streamed."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "tiny"
ASK = [{"role": "user", "content": "Think, then answer."}]
EXTRA = {"ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"), initializer_range=0.3)
    srv = RemoteServer(model_dir, ["--served-model-name", MODEL, "--max-model-len", "512",
                                   "--reasoning-parser", "deepseek_r1"], tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(server):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    message = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, extra_body=EXTRA).choices[0].message
    reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
    assert reasoning, "the parser found no reasoning: the checks below would check nothing"
    return reasoning, message.content


def test_responses_reasoning_item(server, reference):
    reasoning, content = reference
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    r = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=12, extra_body=EXTRA)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == reasoning
    assert r.output_text == (content or "")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens == 12
    events = list(oai.responses.create(model=MODEL, input=ASK, max_output_tokens=12, stream=True, extra_body=EXTRA))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == reasoning and [e.sequence_number for e in events] == list(range(len(events)))


def test_messages_thinking_block(server, reference):
    reasoning, content = reference
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    m = claude.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=EXTRA)
    assert m.content[0].type == "thinking" and m.content[0].thinking == reasoning
    assert "".join(b.text for b in m.content if b.type == "text") == (content or "")
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=ASK, extra_body=EXTRA) as stream:
        thinking = "".join(e.thinking for e in stream if e.type == "thinking")
        final = stream.get_final_message()
    assert thinking == reasoning and final.content[0].thinking == reasoning
    # the thinking block passed back is accepted (and left out of the prompt, as the chat template does)
    again = claude.messages.create(model=MODEL, max_tokens=4, extra_body=EXTRA, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump(include={"type", "thinking", "signature", "text"})
                                                for b in final.content]},
        {"role": "user", "content": "And now?"}])
    assert again.usage.output_tokens == 4
