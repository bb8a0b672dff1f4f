"""Formats where the calls are the rest of the output, held until it ends, then parsed whole:

    llama3_json  {"name": "f", "parameters": {...}}; {"name": "g", ...}   (optionally after <|python_tag|>)
                 only when the output opens with it; otherwise it is all content
    mistral      content [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
    pythonic     [f(a=1, b="x"), g()]   (Llama 3.2 / 4 style), only when the output opens with "["

An output that opens a call block but does not parse is returned as content, whole. These formats emit
each call whole even when the output is constrained (`stream_arguments` is accepted and not used yet).
"""

from __future__ import annotations

import ast

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser, arguments_object, held_prefix_len, json_values


class _TailParser(ToolParser):
    """Content until the call block starts, then the block is held to the end and parsed whole."""

    def __init__(self, tool_names, stream_arguments: bool = False) -> None:
        super().__init__(tool_names, stream_arguments)
        self._block: str | None = None  # the held call block, once it started

    def _block_start(self) -> int | None:
        """Where in the buffer the call block starts, or None if no block starts in it (yet)."""
        raise NotImplementedError

    def _content_end(self) -> int:
        """With no block found: how much of the buffer is content for sure (the rest may open one)."""
        raise NotImplementedError

    def _parse_block(self, block: str) -> list[tuple[object, object]] | None:
        """The (name, arguments) pairs of a whole block, or None if it does not parse."""
        raise NotImplementedError

    def _scan(self, final: bool) -> None:
        if self._block is None:
            start = self._block_start()
            if start is None:
                end = len(self._buf) if final else self._content_end()
                self._content(self._buf[:end])
                self._buf = self._buf[end:]
                return
            self._content(self._buf[:start])
            self._block, self._buf = self._buf[start:], ""
        self._block += self._buf
        self._buf = ""
        if final:
            calls = self._parse_block(self._block)
            if calls and all(isinstance(n, str) and n in self.tool_names for n, _ in calls) \
                    and self._all_valid(calls):
                for name, arguments in calls:
                    self._call(name, arguments)
            else:
                self._content(self._block)
            self._block = ""

    @staticmethod
    def _all_valid(calls) -> bool:
        return all(arguments_object(a) is not None for _, a in calls)


class _OpensWith(_TailParser):
    """The block is the whole output when its first non-space text is one of `openers`."""

    openers: tuple[str, ...] = ()

    def __init__(self, tool_names, stream_arguments: bool = False) -> None:
        super().__init__(tool_names, stream_arguments)
        self._is_content = False

    def _block_start(self) -> int | None:
        stripped = self._buf.lstrip()
        if not self._is_content and any(stripped.startswith(o) for o in self.openers):
            return 0
        if stripped and not any(o.startswith(stripped) for o in self.openers):
            self._is_content = True
        return None

    def _content_end(self) -> int:
        return len(self._buf) if self._is_content else 0


class Llama3JsonToolParser(_OpensWith):
    name = "llama3_json"
    openers = ("<|python_tag|>", "{")
    needs_special_tokens = True

    def _parse_block(self, block: str):
        values = json_values(block.strip().removeprefix("<|python_tag|>"), ";")
        if not values or not all(isinstance(v, dict) and set(v) <= {"name", "parameters", "arguments"}
                                 for v in values):
            return None
        return [(v.get("name"), v.get("parameters", v.get("arguments"))) for v in values]


class PythonicToolParser(_OpensWith):
    name = "pythonic"
    openers = ("[",)
    _LITERALS = {"true": True, "false": False, "null": None}

    def _parse_block(self, block: str):
        try:
            tree = ast.parse(block.strip(), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                arguments = {kw.arg: self._literal(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return None
            if len(arguments) != len(node.keywords):
                return None
            calls.append((node.func.id, arguments))
        return calls

    def _literal(self, node: ast.expr):
        if isinstance(node, ast.Name) and node.id in self._LITERALS:  # JSON spellings too
            return self._LITERALS[node.id]
        if isinstance(node, ast.List):
            return [self._literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self._literal(k): self._literal(v) for k, v in zip(node.keys, node.values)}
        value = ast.literal_eval(node)
        if isinstance(value, (tuple, set, bytes, complex)):
            raise ValueError("not a JSON value")
        return value


class MistralToolParser(_TailParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    needs_special_tokens = True

    def _block_start(self) -> int | None:
        i = self._buf.find(self.MARKER)
        return i if i >= 0 else None

    def _content_end(self) -> int:
        return len(self._buf) - held_prefix_len(self._buf, self.MARKER)

    def _parse_block(self, block: str):
        values = json_values(block.removeprefix(self.MARKER), "")
        if values is None or len(values) != 1:
            return None
        calls = values[0] if isinstance(values[0], list) else [values[0]]
        if not all(isinstance(v, dict) and set(v) <= {"name", "arguments", "id"} for v in calls):
            return None
        return [(v.get("name"), v.get("arguments")) for v in calls]
