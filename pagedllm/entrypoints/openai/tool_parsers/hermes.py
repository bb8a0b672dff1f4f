"""Hermes / Qwen2.5 / Qwen3: calls as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
blocks, possibly several, with content around them.

Not constrained, each call is held until </tool_call>, then emitted (or, if broken, given back as content):

    text <tool_call>{...}</tool_call>\n<tool_call>{...}</tool_call>
    └─ content ─┘└──── held, then a call or content ─────┘

Constrained (`stream_arguments`), a call is committed once its header is read up to the brace that opens
its arguments, and they stream as they grow; the object's end is found by counting brackets outside
strings, so the wrapper's closing `}` is never sent, and a trailing partial escape is held back:

    <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>
    └────────── header: name ─────────────┘└── arguments ──┘└─ dropped ─┘

A header in another shape (arguments before the name, say) or naming an unknown tool is not committed:
that call is held as above.
"""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import JsonValueEnd, ToolParser, held_prefix_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
"""A call's opening up to its arguments' `{`: matches a prefix of the text only if it matches the whole."""


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tool_names, stream_arguments: bool = False) -> None:
        super().__init__(tool_names, stream_arguments)
        self._in_call = False
        self._hold_call = False  # this call's header will not be committed: hold it whole
        self._args: JsonValueEnd | None = None  # the committed call's arguments, while read
        self._held_args = ""  # a partial escape at the end of the arguments so far

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
                self._in_call, self._hold_call = True, not self.stream_arguments
            if self._args is None and not self._hold_call:
                self._try_commit()
            if self._args is not None:
                if not self._stream_arguments(final):
                    return
                continue
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

    def _try_commit(self) -> None:
        m = HEADER.match(self._buf)
        if m is None:
            return  # not yet (or never: then the call is held to its end)
        try:
            name = json.loads(m.group(1))
        except ValueError:
            name = None
        if name not in self.tool_names:
            self._hold_call = True
            return
        self._open_call(name)
        self._buf = self._buf[m.end():]
        self._args = JsonValueEnd()

    def _stream_arguments(self, final: bool) -> bool:
        """Send the committed call's arguments as far as they are known; True once the call is over."""
        args = self._args
        if not args.done:
            n = args.feed(self._buf)
            text, self._buf = self._held_args + self._buf[:n], self._buf[n:]
            keep = 0 if args.done or final else args.partial
            self._arguments(text[:len(text) - keep])
            self._held_args = text[len(text) - keep:]
            if not args.done and not final:
                return False
        j = self._buf.find(CLOSE)  # what is left of the wrapper (`}\n`) is dropped
        if j < 0 and not final:
            return False
        self._buf = "" if j < 0 else self._buf[j + len(CLOSE):]
        self._in_call, self._args = False, None
        return True

    def _body_call(self, body: str) -> bool:
        try:
            obj = json.loads(body)
        except ValueError:
            return False
        if not isinstance(obj, dict) or set(obj) - {"name", "arguments", "parameters"}:
            return False
        return self._call(obj.get("name"), obj.get("arguments", obj.get("parameters")))
