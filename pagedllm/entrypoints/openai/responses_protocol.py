"""The body of POST /v1/responses (OpenAI's Responses API), and its translation into a chat request.

    input item                                  chat message
    {"role": r, "content": str | parts}         {"role": r, "content": the parts' text}  (developer: system)
    {"type": "function_call", call_id, ...}     an assistant message's tool_calls (consecutive calls join)
    {"type": "function_call_output", ...}       {"role": "tool", "tool_call_id": call_id, "content": output}
    {"type": "reasoning", ...}                  left out (chat templates drop past reasoning too)

`instructions` is a system message in front (a previous response's instructions are not carried over,
as OpenAI's API says). Tools are function tools; `text.format` is the chat path's response_format.
What the server cannot serve (images, files, built-in tools, item references) is a 400 that says so.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import OpenAIModel

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "ignore_eos", "stop", "presence_penalty",
                    "frequency_penalty", "priority", "cache_salt", "skip_special_tokens")
"""vLLM-style sampling extras a Responses body may carry (the SDK's extra_body), passed to the chat request."""
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on a response's metadata."""


class TextFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class TextConfig(OpenAIModel):
    format: Optional[TextFormat] = None


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. Unknown fields are ignored, except the sampling extras of _SAMPLING_EXTRAS."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    metadata: Optional[dict[str, str]] = None
    truncation: Literal["auto", "disabled"] = "disabled"
    stream: bool = False
    user: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None

    def input_items(self) -> list[dict]:
        """The input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return [dict(item) for item in self.input]

    def check(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS:
            raise APIError(400, f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", param="metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise APIError(400, f"metadata.{key[:64]}: keys are at most {MAX_METADATA_KEY_CHARS} characters, "
                                    f"values at most {MAX_METADATA_VALUE_CHARS}", param="metadata")

    def chat_body(self, items: list[dict]) -> dict:
        """The chat request (as a body) of this request over `items`, the whole conversation's items."""
        messages = chat_messages(items)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise APIError(400, "input: the conversation is empty; give at least one message", param="input")
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        body.update({k: v for k, v in (self.model_extra or {}).items() if k in _SAMPLING_EXTRAS})
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, "text.format: a json_schema format needs its schema", param="text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name,
                                                                             "schema": fmt.schema_}}
        return body


def chat_tool(tool: dict, i: int) -> dict:
    """A Responses function tool as a chat tool."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools.{i}.type: only function tools are served, got {tool.get('type')!r}",
                       param=f"tools.{i}.type")
    if not isinstance(tool.get("name"), str):
        raise APIError(400, f"tools.{i}.name: a function tool needs its name", param=f"tools.{i}.name")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    for key in ("description", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice: "none", "auto", "required" or {"type": "function", "name": ...}',
                   param="tool_choice")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content is a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise APIError(400, f"{where}.{j}: only text parts are served (this server's models read text), "
                                f"got {kind!r}", param=f"{where}.{j}")
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


def chat_messages(items: list[dict]) -> list[dict]:
    """Chat messages of a conversation's items (see the module doc); 400 naming the item at fault."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: user, assistant, system or developer, got {role!r}",
                               param=f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
                raise APIError(400, f"{where}: a function_call item needs call_id and name", param=where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}.call_id: a function_call_output item needs the call_id it answers",
                               param=f"{where}.call_id")
            content = output if isinstance(output, str) else _text(output, f"{where}.output") \
                if isinstance(output, list) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}.type: {kind!r} items are not served (messages, function_call, "
                                f"function_call_output and reasoning are)", param=f"{where}.type")
    return messages


def truncated(items: list[dict]) -> list[dict] | None:
    """`items` less its oldest turn (up to the next user message), for truncation "auto"; None when only one
    turn is left."""
    users = [i for i, item in enumerate(items) if item.get("type", "message") == "message"
             and item.get("role") == "user"]
    later = [i for i in users if i > 0 and any(item.get("role") != "system" for item in items[:i])]
    if not later:
        return None
    keep = [item for item in items[:later[0]] if item.get("role") in ("system", "developer")]
    return keep + items[later[0]:]
