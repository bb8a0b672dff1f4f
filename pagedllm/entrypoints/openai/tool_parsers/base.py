"""What every tool-call parser shares: the parsed call, the incremental contract, and the helpers
that keep a stream from emitting text it would later take back.

A parser is fed the model's text in pieces (`feed`) and told when it ends (`finish`); each returns
a ParsedDelta: content to show now, and call deltas (a call's first names it, the rest carry pieces of
its arguments' JSON text). Nothing emitted is ever taken back; when a call is emitted depends on
whether the output was generated under a grammar that admits only valid calls (`stream_arguments`):

- not constrained (tool_choice auto in a format with no grammar): a call is emitted only once it is
  complete and valid (its arguments parse as JSON and name one of the request's tools), name and all
  arguments at once; a broken one comes back as content, whole.
- constrained (required, named, and auto in a format whose opened calls the grammar constrains): the
  call is committed as soon as its name is known and its arguments open, and the arguments stream as
  the model writes them (hermes; the other formats still emit each call whole). The grammar makes
  every committed call valid, except one the output ends inside (max_tokens or a stop string): that
  call keeps the arguments written so far and the choice finishes with that finish_reason.

The non-streaming parse is the same machine fed the whole text at once (`parse`), so a stream split
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


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of the call numbered `index`: its first names it; every one may carry arguments text."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass(slots=True)
class Parsed:
    """A whole output parsed: its content and its calls."""

    content: str
    calls: list[ToolCall]


def assemble(deltas: Iterable[CallDelta]) -> list[ToolCall]:
    """The calls that call deltas add up to, in index order."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index not in names, f"call {d.index} named twice"
            names[d.index], arguments[d.index] = d.name, ""
        arguments[d.index] += d.arguments
    return [ToolCall(names[i], arguments[i]) for i in sorted(names)]


class ToolParser:
    """Base class: content handling shared by every format. Subclasses implement `_scan(final)`,
    which consumes `self._buf` as far as it can decide, calling `_content` and `_call`."""

    name: str = ""
    needs_special_tokens = False
    """Whether the format's markers are special tokens that detokenizing must keep."""

    def __init__(self, tool_names: Iterable[str], stream_arguments: bool = False) -> None:
        self.tool_names = frozenset(tool_names)
        self.stream_arguments = stream_arguments
        """The output is grammar-constrained: commit calls early and stream their arguments (module doc)."""
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

    def parse(self, text: str) -> Parsed:
        """The whole output at once: the same machine as streaming, so the two always agree."""
        out = self.feed(text)
        out.extend(self.finish())
        return Parsed(out.content, assemble(out.calls))

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
        self._open_call(name)
        self._arguments(json.dumps(arguments, ensure_ascii=False))
        return True

    def _open_call(self, name: str) -> None:
        """Commit a call to `name`: from here on it is a call, whatever follows."""
        self._pending_ws = ""  # whitespace before a call is layout, not content
        self._after_call = True
        self._out.calls.append(CallDelta(self.num_calls, name, ""))
        self.num_calls += 1

    def _arguments(self, text: str) -> None:
        """More arguments text of the call opened last (joined to a piece still in this delta)."""
        if not text:
            return
        calls = self._out.calls
        if calls and calls[-1].index == self.num_calls - 1 and calls[-1].name is None:
            text = calls.pop().arguments + text
        calls.append(CallDelta(self.num_calls - 1, None, text))

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


class JsonValueEnd:
    """Where a JSON object or array that opens at the start of a text ends, read a piece at a time
    (strings and escapes tracked, brackets counted; validity is the grammar's business). `partial` is the
    length of an escape the text read so far ends inside (`\\` or `\\u` and under four hex digits):
    a stream holds it back until the escape is whole."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.partial = 0
        self._hex_left = 0
        self.done = False

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the value: all of it, unless the value ends inside it."""
        for i, c in enumerate(text):
            if self.in_string:
                if self._hex_left:
                    self._hex_left -= 1
                    self.partial = self.partial + 1 if self._hex_left else 0
                elif self.partial:  # the character after a backslash
                    self._hex_left = 4 if c == "u" else 0
                    self.partial = 2 if c == "u" else 0
                elif c == "\\":
                    self.partial = 1
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
        return len(text)
