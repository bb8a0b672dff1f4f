"""What every tool-call parser shares: the parsed call, the incremental contract, and the helpers
that keep a stream from emitting text it would later take back.

A parser is fed the model's text in pieces (`feed`) and told when it ends (`finish`); each returns
a ParsedDelta: content to show now, and calls that are complete. A call is emitted only once it is
complete and valid (its arguments parse as JSON and name one of the request's tools), so nothing
emitted is ever taken back: text that might open a call is held until the parser can tell. The
non-streaming parse is the same machine fed the whole text at once (`parse`), so a stream split
anywhere assembles exactly what the one-shot parse returns (tests/entrypoints/test_tool_parsers.py).

Content whitespace is held until text follows it: whitespace before, between or after calls is layout
and dropped (emitted at the end when the output made no call).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (what OpenAI's function.arguments carries)."""


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolParser:
    """Base class: content handling shared by every format. Subclasses implement `_scan(final)`,
    which consumes `self._buf` as far as it can decide, calling `_content` and `_call`."""

    name: str = ""
    needs_special_tokens = False
    """Whether the format's markers are special tokens that detokenizing must keep."""

    def __init__(self, tool_names: Iterable[str]) -> None:
        self.tool_names = frozenset(tool_names)
        self._buf = ""
        self._pending_ws = ""
        self._out = ParsedDelta()
        self._after_call = False
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        self._scan(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._scan(final=True)
        if self.num_calls == 0:
            self._out.content += self._pending_ws
        self._pending_ws = ""
        return self._take()

    def parse(self, text: str) -> ParsedDelta:
        """The whole output at once: the same machine as streaming, so the two always agree."""
        out = self.feed(text)
        out.extend(self.finish())
        return out

    # ---- for subclasses ----

    def _scan(self, final: bool) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if self._after_call:  # the whitespace that follows a call is layout too
            text = text.lstrip()
            self._after_call = not text
        text = self._pending_ws + text
        head = text.rstrip()
        self._pending_ws = text[len(head):]
        self._out.content += head

    def _call(self, name: object, arguments: object) -> bool:
        """Record a call if it is valid (a known tool's name, JSON arguments); False if not."""
        arguments = arguments_object(arguments)
        if not isinstance(name, str) or name not in self.tool_names or arguments is None:
            return False
        self._pending_ws = ""  # whitespace before a call is layout, not content
        self._after_call = True
        self._out.calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        self.num_calls += 1
        return True

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out


def arguments_object(arguments: object) -> dict | None:
    """A call's arguments as the object they must be (given as one, as its JSON text, or absent); None if not."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        return {}
    return arguments if isinstance(arguments, dict) else None


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def json_values(text: str, separators: str) -> list | None:
    """The JSON values of `text` one after another, separated by whitespace or the `separators`
    characters; None unless all of it parses."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
