"""Tool calling beside a reasoning parser, through a real `pagedllm serve` of the embedded SmolLM2-135M-Instruct and
the official `openai` client: deepseek_r1 reasoning, the pythonic tool-call parser, and `auto` refused without
--enable-auto-tool-choice. (Its own module, so that its server starts on the other pytest worker from
test_tool_server.py's.)"""

from __future__ import annotations

import openai
import pytest

from pagedllm.model.loader import resolve_hf_dir
from tests.entrypoints.server_helpers import RemoteServer
from tests.entrypoints.test_tool_server import ASK, MODEL, SCHEMAS, TOOLS, _check_calls, _param_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    srv = RemoteServer(resolve_hf_dir(None), ["--max-model-len", "1024", "--served-model-name", MODEL,
                                             "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "pythonic"],
                       tmp_path_factory.mktemp("logs") / "reasoning.log")
    yield srv
    srv.stop()


def test_reasoning_parser_and_auto_needs_its_flag(reasoning_server):
    """deepseek_r1 reads the output as reasoning until </think>: SmolLM2 never closes it, so all it writes is
    reasoning_content, streamed as delta.reasoning_content; and without --enable-auto-tool-choice, auto is a 400."""
    client = openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, seed=4, temperature=0)
    message = r.choices[0].message.model_dump()
    assert message["reasoning_content"] and message["content"] is None
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, seed=4, temperature=0,
                                            stream=True)
    streamed = "".join((c.choices[0].delta.model_dump().get("reasoning_content") or "") for c in stream if c.choices)
    assert streamed == message["reasoning_content"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8)
    assert _param_of(info.value) == "tool_choice" and "--enable-auto-tool-choice" in info.value.response.text
    # a forced call comes after the reasoning (deepseek_r1: after </think>), in the pythonic format: SmolLM2 is no
    # reasoning model and may never close its thought; whatever it does, the calls that come validate
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=4, seed=6,
                                       max_tokens=200)
    for choice in r.choices:
        message = choice.message.model_dump()
        assert message["reasoning_content"] is not None
        if choice.finish_reason != "length":
            _check_calls(choice.message.tool_calls, set(SCHEMAS), True)
    reasoning_server.wait_idle_without_leaks()
