"""A chat's messages and the template that renders them into a prompt: for /v1/chat/completions (and /tokenize,
and the Responses and Messages APIs through it), and for ``LLM.chat`` (``render_chat``).

Messages (``ChatMessage``), each checked by OpenAI's rules for its role.
OpenAI's Chat Completions API (its OpenAPI spec) requires, per role:

    role        content                                   also
    system      string, or a non-empty list of text parts
    developer   string, or a non-empty list of text parts
    user        string, or a non-empty list of text, image_url, input_audio or file parts
    assistant   string, a non-empty list of text or refusal parts, or null/absent when the
                message has tool_calls or function_call
    tool        string, or a non-empty list of text parts     tool_call_id (string)
    function    string or null (the key itself required)      name (string)

A body that breaks one of these is a 400 here as there, naming the field (`messages.2.content`).
Across messages (`check_tool_history`), as OpenAI: each tool_calls entry has a unique id, a tool
message answers an id of the assistant message just before it (or of the tool messages between),
and every call is answered before the conversation goes on.
What OpenAI accepts but this server cannot serve is a 400 that says so: images, audio and files
(the models are text-only), and the deprecated `function_call` and `function` messages (use
tool_calls and tool messages), as the request's `functions` field is.

Templates (``render_chat``). Chat templates are code from a model file (or, where the server allows it, from a
request): rendered in Jinja's ``ImmutableSandboxedEnvironment`` as transformers renders them, and under a budget.

transformers' sandbox already refuses ``__class__``, ``__globals__`` and mutation of the data it is given;
it has no bound on the work a template does. A template is stopped, with ``ChatTemplateError`` (HTTP 400),
when it renders for longer than ``RENDER_TIME_BUDGET_S`` or produces more than ``MAX_RENDERED_CHARS``:

- output: the environment's ``concat`` counts the characters as the template yields them; ``*``, ``**``,
  ``%``, filters and str/list methods are checked before they run (``"x" * 10**10``, ``center(10**9)`` would
  take the memory first: a size argument past the budget is refused), and their results after;
- time: checked at each chunk and call, and at each line of the compiled template (a trace function on
  the template's own frames while it renders), so a loop that outputs and calls nothing is stopped too.

transformers builds its environment from the ``ImmutableSandboxedEnvironment`` name in its
``chat_template_utils``; ``_install`` points that name at ``BudgetedSandbox``, a subclass, at the first
render. Rendering is otherwise transformers' own (its context, its special tokens, its tokenization),
so the token ids are the ones ``apply_chat_template`` gives.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import threading
import time
import types
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Optional, Union

from jinja2 import Environment
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, model_validator

from pagedllm.errors import InvalidRequestError

PART_TYPES = {
    "system": ("text",), "developer": ("text",), "tool": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
}
"""The content part types OpenAI allows in each role's content list."""
_TEXT_FIELD = {"text": "text", "refusal": "refusal"}
"""The part types this server reads, and the field holding each one's text."""
NO_FUNCTIONS = "the deprecated function calling is not supported; use tools, tool_calls and tool messages"


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str


class ToolCallItem(BaseModel):
    """One entry of an assistant message's tool_calls, as OpenAI returned it."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Any = None
    refusal: Any = None


class ChatMessage(BaseModel):
    """A message; `model_validator` applies the rules of the module doc. Each refusal is a ValueError
    whose text starts with the offending field ("content: ..."), which the body parser appends to the
    message's location (see http_intake.parse_model)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[ToolCallItem]] = None
    function_call: Optional[Any] = None

    @model_validator(mode="after")
    def _openai_rules(self) -> ChatMessage:
        role, content = self.role, self.content
        if role == "function":
            if "content" not in self.model_fields_set:
                raise ValueError("content: a function message needs content (a string or null)")
            if isinstance(content, list):
                raise ValueError("content: a function message's content is a string or null, not a list")
            if self.name is None:
                raise ValueError("name: a function message needs the name of the function it answers")
            raise ValueError(f"role: function messages answer a function_call: {NO_FUNCTIONS}")
        if role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the tool_call_id of the call it answers")
        if role == "assistant":
            if self.tool_calls is not None and not self.tool_calls:
                raise ValueError("tool_calls: the list is empty; leave the field out instead")
            has_calls = bool(self.tool_calls) or self.function_call is not None
            if content is None and not has_calls:
                raise ValueError("content: an assistant message needs content unless it has tool_calls "
                                 "or function_call")
        elif content is None:
            raise ValueError(f"content: a {role} message needs content (a string or a non-empty list of "
                             f"content parts)")
        if isinstance(content, list):
            _check_parts(role, content)
        if self.tool_calls and role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages have tool_calls, not {role} messages")
        if self.function_call is not None:
            raise ValueError(f"function_call: not supported: {NO_FUNCTIONS}")
        return self

    def text(self) -> str:
        """The message's text: its string, or its parts' texts joined (validated: all are text)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(getattr(part, _TEXT_FIELD[part.type]) for part in self.content)

    def turn(self) -> dict:
        """The message as a chat template takes it when no tool is involved: its role and its text."""
        return {"role": self.role, "content": self.text()}


def check_tool_history(messages: list[ChatMessage]) -> None:
    """The rules across messages of the module doc; ValueError("messages.N.field: ...")."""
    pending: dict[str, int] = {}  # call id -> index of the assistant message that made it, unanswered
    seen: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "tool":
            if not pending and not (i and messages[i - 1].role == "tool"):
                raise ValueError(f"messages.{i}.role: a tool message must answer the tool_calls of the assistant "
                                 f"message before it")
            if m.tool_call_id not in pending:
                known = "answered already" if m.tool_call_id in seen else "not one of the calls it answers"
                raise ValueError(f"messages.{i}.tool_call_id: {m.tool_call_id!r} is {known}")
            del pending[m.tool_call_id]
            continue
        if pending:
            first = min(pending.values())
            raise ValueError(f"messages.{first}.tool_calls: each call must be answered by a tool message before the "
                             f"conversation goes on; unanswered: {', '.join(map(repr, pending))}")
        for call in m.tool_calls or ():
            if call.id in seen:
                raise ValueError(f"messages.{i}.tool_calls: the call id {call.id!r} is used twice")
            seen.add(call.id)
            pending[call.id] = i


def _check_parts(role: str, parts: list[ContentPart]) -> None:
    if not parts:
        raise ValueError("content: the list of content parts is empty; give at least one part")
    allowed = PART_TYPES[role]
    for i, part in enumerate(parts):
        if part.type not in allowed:
            raise ValueError(f"content.{i}.type: a {role} message's content parts are {_listed(allowed)}, "
                             f"got {part.type!r}")
        field = _TEXT_FIELD.get(part.type)
        if field is None:
            raise ValueError(f"content.{i}.type: {part.type} content parts are not supported: this server's "
                             f"models read text only")
        if not isinstance(getattr(part, field), str):
            raise ValueError(f"content.{i}.{field}: a {part.type} part needs its {field} as a string")


def _listed(names: tuple[str, ...]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


# --- the chat template ----------------------------------------------------------------------

RENDER_TIME_BUDGET_S = 2.0
"""Longest a chat template may render: real templates take milliseconds on a long conversation."""
MAX_RENDERED_CHARS = 4 << 20
"""Longest rendered prompt, in characters: about a million tokens of text, the longest context a model file may
declare here (``gguf_model_checks.MAX_CONTEXT``)."""
_MAX_POWER_BITS = 4096


class ChatTemplateError(InvalidRequestError):
    """A chat template that ran past its budget or cannot be used as asked (HTTP 400)."""


class _Budget(threading.local):
    deadline: float | None = None
    budget_s: float = RENDER_TIME_BUDGET_S
    max_chars: int = MAX_RENDERED_CHARS


_budget = _Budget()


def _check_time() -> None:
    deadline = _budget.deadline
    if deadline is not None and time.monotonic() > deadline:
        _budget.deadline = None  # one error per render: the handlers that unwind it must not raise again
        raise ChatTemplateError(f"the chat template ran past its render budget of {_budget.budget_s:g} s")


def _too_long(size: int) -> None:
    if _budget.deadline is not None and size > _budget.max_chars:
        _budget.deadline = None
        raise ChatTemplateError(f"the chat template's output exceeds {_budget.max_chars} characters")


def _bounded_concat(chunks: Iterable[str]) -> str:
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        _too_long(size)
        _check_time()
        parts.append(chunk)
    return "".join(parts)


def _check_arguments(name: str, value, args: tuple, kwargs: dict) -> None:
    """Before a filter or a str/list method runs: refuse a size argument past the output budget (``center``,
    ``indent``, ``format``'s ``%*s``, ``ljust``...) and a ``replace`` whose result would be past it."""
    if _budget.deadline is None:
        return
    _check_time()
    for arg in (*args, *kwargs.values()):
        if type(arg) is int and abs(arg) > _budget.max_chars:
            _budget.deadline = None
            raise ChatTemplateError(f"the chat template passes {arg} to {name}, past its output budget of "
                                    f"{_budget.max_chars} characters")
    if name == "replace" and isinstance(value, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[:2]
        _too_long(len(value) + (value.count(old) if old else len(value) + 1) * len(new))


def _budgeted_filter(name: str, func):
    @functools.wraps(func)  # keeps Jinja's pass_context / pass_eval_context marks
    def run(*args, **kwargs):
        first = next((i for i, a in enumerate(args) if not isinstance(a, (Context, EvalContext, Environment))), 0)
        _check_arguments(name, args[first] if len(args) > first else None, args[first + 1:], kwargs)
        result = func(*args, **kwargs)
        if isinstance(result, (str, list, tuple)):
            _too_long(len(result))
        return result

    return run


class _BudgetedFilters(dict):
    """The environment's filters, each checked before and after it runs (compiled templates look them up here
    once per render, so filters transformers adds after building the environment are covered too)."""

    def __getitem__(self, name):
        return _budgeted_filter(name, super().__getitem__(name))


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """transformers' immutable sandbox, bounded by the current render's budget (module docstring)."""

    intercepted_binops = frozenset({"*", "**", "%"})
    concat = staticmethod(_bounded_concat)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.filters = _BudgetedFilters(self.filters)

    def call_binop(self, context, operator, left, right):
        _check_time()
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(times, int):
                    _too_long(len(sequence) * max(times, 0))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * math.log2(abs(left)) > _MAX_POWER_BITS:
                raise ChatTemplateError(f"the chat template computes {left} ** {right}, a number over "
                                        f"{_MAX_POWER_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_arguments("%", left, right if isinstance(right, tuple) else (right,), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        _check_time()
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(__obj.__self__, (str, list)):
            _check_arguments(__obj.__name__, __obj.__self__, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, list, tuple)):
            _too_long(len(result))
        return result


def _trace_calls(frame, event, arg):
    if frame.f_code.co_filename == "<template>":  # the code Jinja compiled the template into
        _check_time()
        return _trace_lines
    return None


def _trace_lines(frame, event, arg):
    if event == "line":
        _check_time()
    return _trace_lines


def _install() -> None:
    """Have transformers build its template environments as ``BudgetedSandbox`` (at the first render: importing
    this module imports no transformers)."""
    from transformers.utils import chat_template_utils

    if chat_template_utils.ImmutableSandboxedEnvironment is not BudgetedSandbox:
        chat_template_utils.ImmutableSandboxedEnvironment = BudgetedSandbox
        chat_template_utils._compile_jinja_template.cache_clear()  # compiled before: built without the budget


_install()

def _apply_chat_template_params() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)


def render_chat(tokenizer, messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = True,
                chat_template: str | None = None, template_kwargs: Mapping | None = None,
                budget_s: float = RENDER_TIME_BUDGET_S, max_chars: int = MAX_RENDERED_CHARS) -> list[int]:
    """Token ids of ``messages`` through ``chat_template`` (default: the tokenizer's), rendered in the sandbox
    under the budget; ``template_kwargs`` are extra variables for the template. ChatTemplateError when the
    budget runs out or a variable would override an argument; the template's own errors propagate."""
    extra = dict(template_kwargs or {})
    reserved = sorted(set(extra) & (_apply_chat_template_params() | {"messages", "tools", "documents"}))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    _install()
    _budget.budget_s, _budget.max_chars = budget_s, max_chars
    _budget.deadline = time.monotonic() + budget_s
    previous = sys.gettrace()
    sys.settrace(_trace_calls)
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=True, chat_template=chat_template, **extra)
    finally:
        sys.settrace(previous)
        _budget.deadline = None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)

