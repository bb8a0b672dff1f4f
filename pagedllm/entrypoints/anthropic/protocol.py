"""The body of POST /v1/messages (Anthropic's Messages API), and its translation into a chat request.

    Anthropic                                   chat
    system (string or text blocks)              a system message in front
    {"role": "system", ...} in messages         a system message (Claude Code sends these)
    text blocks                                 the message's text
    tool_use blocks (assistant)                 tool_calls, `input` as JSON arguments
    tool_result blocks (user)                   tool messages, before the rest of the user's text
    thinking / redacted_thinking blocks         left out (chat templates drop past reasoning too)
    tools [{name, description, input_schema}]   function tools
    tool_choice auto / any / tool / none        auto / required / named / none
    stop_sequences, top_k                       stop, top_k
    output_config.format (json_schema)          response_format (structured outputs)

Images and documents are a 400 that says so: this server's models read text.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import APIError


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None

    def chat_body(self) -> dict:
        """The chat request (as a body) of this request; 400 naming the field at fault."""
        messages = chat_messages(self.messages)
        if self.system:
            messages.insert(0, {"role": "system", "content": _text(self.system, "system")})
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"], parallel = chat_tool_choice(self.tool_choice)
            body["parallel_tool_calls"] = parallel
        return body


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(..., ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop_sequences: Optional[list[str]] = None
    metadata: Optional[dict[str, Any]] = None
    stream: bool = False
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    """Its `format` ({"type": "json_schema", "schema": ...}) constrains the text (structured outputs)."""
    ignore_eos: bool = False
    """vLLM-style extra (extra_body): generate max_tokens tokens whatever the model's end token."""

    def chat_body(self) -> dict:
        body = super().chat_body()
        body.update(max_tokens=self.max_tokens, stream=self.stream, ignore_eos=self.ignore_eos)
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                            ("stop", self.stop_sequences)):
            if value is not None:
                body[name] = value
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise APIError(400, 'output_config.format: {"type": "json_schema", "schema": {...}}',
                               param="output_config.format")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        return body


def chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type", "custom") != "custom":
        raise APIError(400, f"tools.{i}.type: only custom tools (name, description, input_schema) are served, "
                            f"got {tool.get('type')!r}", param=f"tools.{i}.type")
    if not isinstance(tool.get("name"), str):
        raise APIError(400, f"tools.{i}.name: a tool needs its name", param=f"tools.{i}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise APIError(400, f"tools.{i}.input_schema: a tool needs its input_schema (a JSON schema object)",
                       param=f"tools.{i}.input_schema")
    function = {"name": tool["name"], "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: dict) -> tuple[str | dict, bool]:
    """(chat tool_choice, parallel_tool_calls)."""
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, 'tool_choice: {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                        '{"type": "tool", "name": ...}', param="tool_choice")


def _text(content: Any, where: str) -> str:
    """The text of a string or a list of text blocks; 400 for any other block."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(400, f"{where}.{j}: only text blocks are served here (this server's models read "
                                f"text), got {kind!r}", param=f"{where}.{j}")
        texts.append(block["text"])
    return "".join(texts)


def chat_messages(messages: list[dict]) -> list[dict]:
    """Chat messages of Anthropic's messages (see the module doc); 400 naming the block at fault."""
    out: list[dict] = []
    for i, message in enumerate(messages):
        role, content, where = message.get("role"), message.get("content"), f"messages.{i}"
        if role not in ("user", "assistant", "system"):
            raise APIError(400, f"{where}.role: user or assistant, got {role!r}", param=f"{where}.role")
        if isinstance(content, str) or role == "system":
            out.append({"role": role, "content": _text(content, f"{where}.content")})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content: a string or a list of content blocks", param=f"{where}.content")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text":
                texts.append(_text([block], at))
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError(400, f"{at}: a tool_use block needs id and name", param=at)
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{at}.tool_use_id: a tool_result names the tool_use it answers",
                                   param=f"{at}.tool_use_id")
                result = block.get("content", "")
                text = _text(result, f"{at}.content") if result is not None else ""
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            else:
                raise APIError(400, f"{at}.type: a {role} message's blocks here are text, "
                                    f"{'tool_use' if role == 'assistant' else 'tool_result'} and thinking; "
                                    f"got {kind!r}", param=f"{at}.type")
        out.extend(results)
        if role == "assistant" and calls:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not results:
            out.append({"role": role, "content": "".join(texts)})
    return out
