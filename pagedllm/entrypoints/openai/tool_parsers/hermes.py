"""Hermes / Qwen2.5 / Qwen3: calls as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
blocks, possibly several, with content around them.

    text <tool_call>{...}</tool_call>\n<tool_call>{...}</tool_call>
    └─ content ─┘└──────── held until </tool_call>, then a call (or, if broken, content) ──┘
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser, held_prefix_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tool_names) -> None:
        super().__init__(tool_names)
        self._in_call = False

    def _scan(self, final: bool) -> None:
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = 0 if final else held_prefix_len(self._buf, OPEN)
                    self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(OPEN):]
                self._in_call = True
            j = self._buf.find(CLOSE)
            if j < 0 and not final:
                return
            body = self._buf if j < 0 else self._buf[:j]
            self._buf = "" if j < 0 else self._buf[j + len(CLOSE):]
            self._in_call = False
            if not self._body_call(body):  # broken: the model's text goes back as content
                self._content(OPEN + body + ("" if j < 0 else CLOSE))
            if j < 0:
                return

    def _body_call(self, body: str) -> bool:
        try:
            obj = json.loads(body)
        except ValueError:
            return False
        if not isinstance(obj, dict) or set(obj) - {"name", "arguments", "parameters"}:
            return False
        return self._call(obj.get("name"), obj.get("arguments", obj.get("parameters")))
