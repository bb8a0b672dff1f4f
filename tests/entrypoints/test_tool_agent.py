"""A real agent loop against `pagedllm serve` (slow): OpenAI's own Agents SDK (`openai-agents`, chosen because it
is OpenAI's reference client for tool loops and speaks Chat Completions through the same `openai` client the other
tests use, without pinning another version of it) runs a two-tool task on SmolLM2-135M end to end: the model's
calls are parsed by the SDK, validated against the tools' pydantic schemas, executed, their results sent back as
tool messages, and the model answers in text.

SmolLM2-135M does not choose tools under `auto` (see test_tool_server.py): the agent starts with tool_choice
`required`, which the SDK resets after the first tool use (its default), so the second turn is `auto` and ends
the loop with a text answer."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.model.loader import resolve_hf_dir
from tests.entrypoints.server_helpers import RemoteServer

agents = pytest.importorskip("agents")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer(resolve_hf_dir(None), ["--max-model-len", "2048", "--served-model-name", "smol",
                                             "--enable-auto-tool-choice"],
                       tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def test_an_agent_runs_a_two_tool_task(server):
    from openai import AsyncOpenAI

    executed: list[tuple[str, dict]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        executed.append(("get_weather", {"city": city}))
        return f"Sunny and 21 degrees in {city}"

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        executed.append(("add", {"a": a, "b": b}))
        return a + b

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    agent = agents.Agent(
        name="assistant", instructions="Use the tools to answer.", tools=[get_weather, add],
        model=agents.OpenAIChatCompletionsModel(model="smol", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0.0, max_tokens=200,
                                            parallel_tool_calls=True))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Zürich, and what is 2 + 3?", max_turns=4))
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert executed and len(calls) == len(outputs) == len(executed)  # each call ran once and was answered
    assert {name for name, _ in executed} <= {"get_weather", "add"}
    assert isinstance(result.final_output, str) and result.final_output  # the loop ended with a text answer
    print(f"agent: tools run {executed}; answer {result.final_output!r}")
    server.wait_idle_without_leaks()
