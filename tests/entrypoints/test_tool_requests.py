"""Tool requests without a server: OpenAI's rules for tools, tool_choice and the history of calls and results;
how the tools reach a template that takes them and one that does not (SmolLM2's)."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.http_intake import parse_model
from pagedllm.entrypoints.openai.serving_chat import apply_chat_template
from pagedllm.entrypoints.openai.tools import plan_tools
from pagedllm.model.loader import resolve_hf_dir

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]
USER = {"role": "user", "content": "2+3?"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
    {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
HISTORY = [USER, CALLS, {"role": "tool", "tool_call_id": "c2", "content": "noon"},
           {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "user", "content": "thanks"}]


def _refused(body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse_model(ChatCompletionRequest, body)
    assert info.value.status == 400
    return info.value


def test_a_history_of_calls_and_results_is_accepted():
    request = parse_model(ChatCompletionRequest, {"messages": HISTORY, "tools": TOOLS})
    assert request.tool_choice == "auto"  # OpenAI's default with tools
    assert request.messages[1].tool_calls[0].function.arguments == '{"a": 2, "b": 3}'


@pytest.mark.parametrize("messages,param,words", [
    ([USER, {"role": "tool", "tool_call_id": "c1", "content": "5"}], "messages.1.role", "must answer"),
    ([USER, CALLS, {"role": "tool", "tool_call_id": "c9", "content": "5"}], "messages.2.tool_call_id", "not one of"),
    ([USER, CALLS, {"role": "tool", "tool_call_id": "c1", "content": "5"},
      {"role": "tool", "tool_call_id": "c1", "content": "5"}], "messages.3.tool_call_id", "answered already"),
    ([USER, CALLS, {"role": "tool", "tool_call_id": "c1", "content": "5"}, USER], "messages.1.tool_calls",
     "'c2'"),
    ([USER, {**CALLS, "tool_calls": [CALLS["tool_calls"][0], CALLS["tool_calls"][0]]}], "messages.1.tool_calls",
     "used twice"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add"}}]}],
     "messages.1.tool_calls.0.function.arguments", "Field required"),
    ([{**USER, "tool_calls": CALLS["tool_calls"]}], "messages.0.tool_calls", "only assistant"),
])
def test_the_history_follows_openai_rules(messages, param, words):
    error = _refused({"messages": messages, "tools": TOOLS})
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("extra,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "none"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice", "'mul'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "named choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "letters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters", '"object"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters", "dictionary"),
])
def test_tools_and_tool_choice_are_checked(extra, param, words):
    error = _refused({"messages": [USER], **extra})
    assert error.param == param and words in error.message, error.message


def _plan(body: dict, enable_auto=True, parser="hermes"):
    request = parse_model(ChatCompletionRequest, {"messages": [USER], **body})
    return plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, parser, enable_auto)


def test_plans():
    with pytest.raises(APIError) as info:
        _plan({"tools": TOOLS}, enable_auto=False)
    assert info.value.param == "tool_choice" and "--enable-auto-tool-choice" in info.value.message
    with pytest.raises(APIError) as info:
        _plan({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                      "properties": 3}}}]})
    assert info.value.param == "tools.0.function.parameters" and "properties" in info.value.message
    assert _plan({"tools": TOOLS, "tool_choice": "none"}).tools == []
    named = _plan({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert [t.function.name for t in named.called] == ["now"] and "add" not in named.grammar
    assert named.grammar.startswith("root ::= tool_call (")
    assert _plan({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).grammar \
        .startswith("root ::= tool_call\n")
    assert _plan({"tools": TOOLS}).opened_call_grammar is not None
    assert _plan({"tools": TOOLS}, parser="pythonic").opened_call_grammar is None
    assert _plan({}) is None


QWEN_LIKE = """{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_hf_dir(None))


def _rendered(tokenizer, template: str | None, body: dict) -> str:
    tok = copy.copy(tokenizer)
    if template is not None:
        tok.chat_template = template
    request = parse_model(ChatCompletionRequest, body)
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, "hermes", True)
    return tok.decode(apply_chat_template(tok, request.messages, True, plan))


def test_a_template_that_takes_tools_gets_them_and_the_calls_as_objects(tokenizer):
    text = _rendered(tokenizer, QWEN_LIKE, {"messages": HISTORY, "tools": TOOLS})
    assert '"name": "add"' in text and '"description": "Add"' in text  # the tools argument
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text  # arguments as an object
    assert "<tool_response>noon</tool_response>" in text and "<tool_response>5</tool_response>" in text
    assert "You may call" not in text  # not the fallback


def test_smollm2_gets_the_hermes_fallback(tokenizer):
    assert "tools" not in tokenizer.chat_template
    text = _rendered(tokenizer, None, {"messages": [{"role": "system", "content": "Be brief."}, *HISTORY],
                                       "tools": TOOLS})
    assert text.count("<|im_start|>system") == 1 and "Be brief.\n\nYou may call one or more functions" in text
    assert '{"type": "function", "function": {"name": "add", "description": "Add", "parameters": ' in text
    assert '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>" in text
    none = _rendered(tokenizer, None, {"messages": [USER], "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in none  # tool_choice none leaves the tools out


def test_unknown_parser_names_are_refused_naming_the_setting():
    from pagedllm.entrypoints.openai.cli_args import ServerConfig

    for field, value in (("tool_call_parser", "qwen_xml"), ("reasoning_parser", "o1")):
        with pytest.raises(ValueError, match=f"{field} must be one of"):
            ServerConfig(**{field: value})
    assert ServerConfig(reasoning_parser="qwen3", tool_call_parser="pythonic").reasoning_parser == "qwen3"
