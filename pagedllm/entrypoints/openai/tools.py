"""Tool calling for /v1/chat/completions: the request's tools and tool_choice, how they reach the chat
template, the grammar that forces a call, and the parsing of the answer.

    tool_choice   prompt gets the tools   output constrained to                       parsed
    none          no                      (nothing: text)                             no
    auto          yes                     free text; a call once opened (hermes)      calls or text
                                          (needs --enable-auto-tool-choice)
    required      yes                     one call or more to any tool (one if         calls
                                          parallel_tool_calls is false)
    named         yes                     one call or more to that function            calls

Streamed, a call's first delta carries its index, id, type and name, then its arguments follow in pieces:
as the model writes them when the calls are grammar-constrained (every row above but auto in a format
with no grammar), else whole once the call is complete (tool_parsers/base.py says why and what a client
sees when the output ends inside a call).

A template that takes no `tools` (SmolLM2's, for one) gets them the way Hermes-style models are
prompted: a system message listing the tools' JSON schemas and the call format of the server's
--tool-call-parser; earlier calls are written back in that format and tool results as user messages
in <tool_response> tags (as Qwen2.5's template does).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.chat import ChatMessage
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.grammar import (
    FORMATS,
    after_reasoning,
    either_grammar,
    opened_call_grammar,
    tool_call_grammar,
)

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""OpenAI's rule for function names."""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Optional[Any]  # validated in check_tools (a string or NamedToolChoice), so its 400 names the field


def check_tools(tools: list[ToolDefinition] | None, tool_choice: Any) -> str | NamedToolChoice | None:
    """Check tools and tool_choice together; the resolved choice. ValueError("field: ...") naming the field."""
    if isinstance(tool_choice, dict):
        try:
            tool_choice = NamedToolChoice.model_validate(tool_choice)
        except Exception:  # noqa: BLE001 - pydantic's ValidationError
            raise ValueError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}') \
                from None
    elif tool_choice is not None and tool_choice not in ("none", "auto", "required"):
        raise ValueError(f'tool_choice: must be "none", "auto", "required" or a named function, got {tool_choice!r}')
    names = []
    for i, tool in enumerate(tools or ()):
        name = tool.function.name
        if not _NAME.match(name):
            raise ValueError(f"tools.{i}.function.name: a function name is 1 to 64 letters, digits, _ or -, "
                             f"got {name!r}")
        if name in names:
            raise ValueError(f"tools.{i}.function.name: {name!r} is defined twice")
        parameters = tool.function.parameters
        if parameters and parameters.get("type", "object") != "object":
            raise ValueError(f"tools.{i}.function.parameters: the arguments are a JSON object; the schema's type must "
                             f"be \"object\", got {parameters.get('type')!r}")
        names.append(name)
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ValueError("tool_choice: needs tools; give the functions in tools")
        return None
    if tool_choice is None:
        return "auto"  # OpenAI's default when tools are given
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: the function {tool_choice.function.name!r} is not in tools "
                         f"({', '.join(map(repr, names))})")
    return tool_choice


@dataclass
class ToolPlan:
    """What one request does with tools (see the module doc)."""

    parser_name: str
    tools: list[ToolDefinition]
    """The tools the prompt offers (none under tool_choice none)."""
    called: list[ToolDefinition]
    """The tools a call may name."""
    grammar: str | None
    """EBNF forcing the calls (required, named), or None."""
    parallel: bool = True
    """parallel_tool_calls: more than one call allowed."""
    opened_call_grammar: str | None = None
    """Under auto: EBNF of free text whose opened calls are constrained (None: the format has no marker)."""
    constrained: bool = False
    """The calls are generated under a grammar that admits only valid ones: the parser may stream their
    arguments as they grow (tool_parsers/base.py). Set by prepare_tools with the grammar."""

    def auto_grammar(self, answer_format) -> str | None:
        """Under auto, the grammar to generate with: calls constrained once opened, or, with a response_format
        (`answer_format`, an xgrammar Grammar), either that format or forced calls."""
        if answer_format is not None:
            calls = tool_call_grammar(self.parser_name, [(t.function.name, t.function.parameters)
                                                         for t in self.called], self.parallel)
            return either_grammar(answer_format, calls)
        return self.opened_call_grammar


def plan_tools(tools: list[ToolDefinition] | None, choice: str | NamedToolChoice | None, parallel: bool,
               parser_name: str, enable_auto: bool) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools in play); APIError 400 naming the field."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        try:  # every schema is checked, whichever tool_choice, so a bad one is found before it is needed
            tool_call_grammar(parser_name, [(tool.function.name, tool.function.parameters)], False)
        except ValueError as e:
            raise APIError(400, f"tools.{i}.function.parameters: {e}", param=f"tools.{i}.function.parameters") \
                from None
    if choice == "none":
        return ToolPlan(parser_name, [], [], None)
    if choice == "auto":
        if not enable_auto:
            raise APIError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice; '
                                'give "none", "required" or a named function instead', param="tool_choice")
        functions = [(t.function.name, t.function.parameters) for t in tools]
        try:
            opened = opened_call_grammar(parser_name, functions, parallel)
        except Exception as e:  # noqa: BLE001 - a schema xgrammar's structural tags refuse
            raise APIError(400, f"tools: a schema cannot constrain a call: {str(e).strip()[:300]}", param="tools") \
                from None
        return ToolPlan(parser_name, tools, tools, None, parallel, opened)
    called = tools if choice == "required" else [t for t in tools if t.function.name == choice.function.name]
    grammar = tool_call_grammar(parser_name, [(t.function.name, t.function.parameters) for t in called], parallel)
    return ToolPlan(parser_name, tools, called, grammar, parallel)


def prepare_tools(request, parser_name: str, enable_auto: bool, reasoning_parser: str | None) -> ToolPlan | None:
    """Plan a ChatCompletionRequest's tools and set the grammar it generates under (blocking: xgrammar work):
    a forced call's, auto's (an opened call, or the response_format or calls), and with a reasoning parser
    any of these after the reasoning. APIError/InvalidRequestError (400) naming the field."""
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, parser_name, enable_auto)
    if plan is not None:
        if plan.grammar is not None:
            request.set_grammar(plan.grammar, forced_call=True)
            plan.constrained = True
        elif plan.called:
            answer_format = request.structured_outputs_params()
            answer = _grammar_of(answer_format) if answer_format is not None else None
            grammar = plan.auto_grammar(answer)
            request.set_grammar(grammar, forced_call=False)
            plan.constrained = grammar is not None
        if plan.called and TOOL_PARSERS[plan.parser_name].needs_special_tokens:
            request.skip_special_tokens = False  # its markers ([TOOL_CALLS], <|python_tag|>) are special tokens
    if reasoning_parser is not None and (spec := request.structured_outputs_params()) is not None:
        # calls and formats apply to the answer after the reasoning
        request.set_grammar(after_reasoning(_grammar_of(spec), reasoning_parser), forced_call=False)
    return plan


def _grammar_of(spec):
    """The xgrammar Grammar of a structured-output spec (to join with calls or reasoning); 400 if invalid."""
    from pagedllm.structured.grammar import build_grammar  # torch and xgrammar only when used

    try:
        return build_grammar(spec)
    except ValueError as e:
        raise APIError(400, str(e), param="structured_outputs" if spec.kind != "json" else "response_format") \
            from None


# ---- the prompt ----

def template_takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template if isinstance(template, str) else any("tools" in t for t in dict(template).values())


def conversation(messages: list[ChatMessage], plan: ToolPlan | None, native: bool) -> tuple[list[dict], list | None]:
    """(messages for the chat template, its `tools` argument): natively when the template takes tools,
    else in the fallback of the module doc."""
    parser_name = plan.parser_name if plan is not None else "hermes"
    tools = [t.model_dump(exclude_none=True) for t in plan.tools] if plan is not None and plan.tools else None
    out: list[dict] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            if native:
                out.append({"role": "assistant", "content": m.text(), "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                  "arguments": _arguments_value(c.function.arguments)}}
                    for c in m.tool_calls]})
            else:
                calls = FORMATS[parser_name].separator.join(
                    written_call(parser_name, c.function.name, c.function.arguments) for c in m.tool_calls)
                fmt = FORMATS[parser_name]
                out.append({"role": "assistant", "content": "\n".join(filter(None, [m.text(), fmt.open + calls +
                                                                                      fmt.close]))})
        elif m.role == "tool":
            if native:
                out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text()})
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        else:
            out.append(m.turn())
    if tools is not None and not native:
        prompt = fallback_system_prompt(parser_name, plan.tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        tools = None
    return out, tools


def fallback_system_prompt(parser_name: str, tools: list[ToolDefinition]) -> str:
    fmt = FORMATS[parser_name]
    example = fmt.open + written_call(parser_name, "function_name", '{"argument": "value"}') + fmt.close
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are described "
            "by these JSON schemas:\n<tools>\n" + listed + "\n</tools>\n\nTo call a function, answer with its "
            "name and arguments in this format:\n" + example)


def written_call(parser_name: str, name: str, arguments: str) -> str:
    """A call as the model writes it in the parser's format."""
    fmt = FORMATS[parser_name]
    begin = fmt.begin.format(name=json.dumps(name, ensure_ascii=False), bare=name)
    if fmt.kwargs:
        value = _arguments_value(arguments)
        args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in value.items()) \
            if isinstance(value, dict) else ""
        return begin + args + fmt.end
    return begin + arguments + fmt.end


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- the answer ----

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceParser:
    """One choice's text through the reasoning parser, then the tool parser: OpenAI message fields."""

    def __init__(self, plan: ToolPlan | None, reasoning_parser: str | None) -> None:
        self.reasoning: ReasoningParser | None = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        self.tools: ToolParser | None = None
        if plan is not None and plan.called:
            self.tools = TOOL_PARSERS[plan.parser_name]((t.function.name for t in plan.called), plan.constrained)
        self.num_calls = 0

    def deltas(self, text: str, final: bool) -> list[dict]:
        """OpenAI stream deltas for the next piece of text (all of it at the end when `final`)."""
        reasoning, answer = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if final and self.reasoning is not None:
            more_reasoning, more_answer = self.reasoning.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        out: list[dict] = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if self.tools is None:
            if answer:
                out.append({"content": answer})
            return out
        parsed = self.tools.feed(answer)
        if final:
            parsed.extend(self.tools.finish())
        if parsed.content:
            out.append({"content": parsed.content})
        for call in parsed.calls:  # a call's first delta: id, type and name; then its arguments in pieces
            if call.name is not None:
                self.num_calls += 1
                out.append({"tool_calls": [{"index": call.index, "id": new_call_id(), "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            if call.arguments:
                out.append({"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]})
        return out

    def message(self, text: str) -> dict:
        """The whole answer as OpenAI's message object."""
        content, reasoning, calls = [], [], []
        for delta in self.deltas(text, final=True):
            content.append(delta.get("content", ""))
            reasoning.append(delta.get("reasoning_content", ""))
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        answer = "".join(content)  # null, as OpenAI's, when the message is calls or reasoning only
        message: dict[str, Any] = {"role": "assistant",
                                   "content": answer or (None if calls or self.reasoning is not None else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(reasoning) or None
        if calls:
            message["tool_calls"] = calls
        return message

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.num_calls else finish_reason
