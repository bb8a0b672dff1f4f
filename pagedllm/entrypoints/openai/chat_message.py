"""One chat message of /v1/chat/completions (and /tokenize), checked by OpenAI's rules for its role.

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
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, model_validator

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
    message's location (see request_body.parse_model)."""

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
