"""The grammar of a forced tool call (tool_choice `required` or a named function) in a parser's format:
only calls to the given tools, each one's arguments valid against its JSON schema, one call or several
(parallel_tool_calls), then the end of the output. Built with xgrammar and handed to the ordinary
structured-output path as EBNF text (StructuredOutputsParams.grammar), so it is validated, cached and
compiled as any other grammar.

    hermes       <tool_call>\\n{"name": "f", "arguments": ARGS}\\n</tool_call>  (joined by "\\n")
    llama3_json  {"name": "f", "parameters": ARGS}                             (joined by "; ")
    mistral      [TOOL_CALLS][{"name": "f", "arguments": ARGS}, ...]
    pythonic     [f(k=VALUE, ...), ...]   (the schema's required properties, in order, as JSON values)

ARGS is compact JSON (", " and ": " separators, as response_format's grammars).

Under tool_choice auto the model writes what it likes until it opens a call; from its opening marker
on, the call is constrained the same way (`opened_call_grammar`, an xgrammar structural tag with the
marker as trigger). Only formats with a marker that can open a call mid-text have it: hermes.
With response_format under auto, the answer is either the format or calls (`either_grammar`).
With a reasoning parser, any of these grammars applies after the reasoning (`after_reasoning`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar (and the torch it imports) is imported by the functions that build grammars, not here: the API
# server imports this module for FORMATS, and a server that never sees `tools` should not pay torch's
# import time and ~220 MB for it.

CALL_RULE = "tool_call"


@dataclass(frozen=True)
class CallFormat:
    """How one call is written: `begin` (with {name} as a JSON string, {bare} as is), the arguments, `end`;
    calls joined by `separator` inside `open` ... `close`."""

    begin: str
    end: str
    separator: str
    open: str = ""
    close: str = ""
    kwargs: bool = False
    """Arguments as Python keyword arguments (pythonic) instead of a JSON object."""


FORMATS = {
    "hermes": CallFormat('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": CallFormat('{{"name": {name}, "parameters": ', "}", "; "),
    "mistral": CallFormat('{{"name": {name}, "arguments": ', "}", ", ", open="[TOOL_CALLS][", close="]"),
    "pythonic": CallFormat("{bare}(", ")", ", ", open="[", close="]", kwargs=True),
}


def object_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters as the schema its arguments follow (none: an empty object)."""
    return parameters if parameters else {"type": "object", "properties": {}}


def tool_call_grammar(parser_name: str, functions: list[tuple[str, dict | None]], parallel: bool) -> str:
    """EBNF (xgrammar's dialect, root rule `root`) of one or more calls to `functions` ((name, parameters)
    pairs) in the format of `parser_name`; ValueError naming a schema xgrammar cannot use."""
    import xgrammar as xgr
    fmt = FORMATS[parser_name]
    calls = []
    for name, parameters in functions:
        begin = fmt.begin.format(name=json.dumps(name, ensure_ascii=False), bare=name)
        calls.append(xgr.Grammar.concat(_literal(begin), _arguments(fmt, name, parameters), _literal(fmt.end)))
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    body = f'{CALL_RULE} ({_quoted(fmt.separator)} {CALL_RULE})*' if parallel else CALL_RULE
    parts = [_quoted(fmt.open) if fmt.open else "", body, _quoted(fmt.close) if fmt.close else ""]
    return "root ::= " + " ".join(p for p in parts if p) + "\n" + rename_root(str(one), CALL_RULE)


TRIGGERS = {"hermes": "<tool_call>"}
"""The marker that opens a call mid-text, per format that has one."""


def opened_call_grammar(parser_name: str, functions: list[tuple[str, dict | None]], parallel: bool) -> str | None:
    """EBNF of free text in which every call, once opened by the format's marker, is a valid call to one of
    `functions` (at most one call when not `parallel`); None for a format without such a marker."""
    import xgrammar as xgr
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TriggeredTagsFormat
    trigger = TRIGGERS.get(parser_name)
    if trigger is None:
        return None
    fmt = FORMATS[parser_name]
    tags = [TagFormat(begin=fmt.begin.format(name=json.dumps(name, ensure_ascii=False), bare=name),
                      content=JSONSchemaFormat(json_schema=object_schema(parameters)), end=fmt.end)
            for name, parameters in functions]
    tag = StructuralTag(format=TriggeredTagsFormat(triggers=[trigger], tags=tags, at_least_one=False,
                                                   stop_after_first=not parallel))
    return str(xgr.Grammar.from_structural_tag(tag))


def either_grammar(answer: xgr.Grammar, calls_ebnf: str) -> str:
    """EBNF of an answer in `answer`'s language or of the calls `calls_ebnf` admits."""
    import xgrammar as xgr
    return str(xgr.Grammar.union(answer, xgr.Grammar.from_ebnf(calls_ebnf)))


def after_reasoning(answer: xgr.Grammar, reasoning_parser: str) -> str:
    """EBNF of free reasoning, then `answer`: for deepseek_r1 text up to </think> (the template opened
    <think>), for qwen3 an optional <think>...</think>; whitespace may follow the reasoning."""
    import xgrammar as xgr
    from xgrammar.structural_tag import AnyTextFormat, OptionalFormat, StructuralTag, TagFormat
    think = TagFormat(begin="<think>" if reasoning_parser == "qwen3" else "", content=AnyTextFormat(), end="</think>")
    reasoning = StructuralTag(format=OptionalFormat(content=think) if reasoning_parser == "qwen3" else think)
    return str(xgr.Grammar.concat(xgr.Grammar.from_structural_tag(reasoning), xgr.Grammar.from_ebnf("root ::= [ \\n]*"),
                                  answer))


def _arguments(fmt: CallFormat, name: str, parameters: dict | None) -> xgr.Grammar:
    import xgrammar as xgr
    schema = object_schema(parameters)
    try:
        if not fmt.kwargs:
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        properties = schema.get("properties") or {}
        required = [k for k in properties if k in (schema.get("required") or ())]
        pieces: list[xgr.Grammar] = []
        for i, key in enumerate(required):
            pieces.append(_literal((", " if i else "") + f"{key}="))
            pieces.append(xgr.Grammar.from_json_schema(properties[key] if isinstance(properties[key], dict) else {},
                                                       any_whitespace=False, strict_mode=True))
        return xgr.Grammar.concat(*pieces) if pieces else xgr.Grammar.from_ebnf('root ::= ""')
    except Exception as e:  # noqa: BLE001 - xgrammar's native errors are RuntimeErrors
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the parameters of {name!r} are not a JSON schema this server can use: "
                         f"{message.split(': ', 1)[-1]}") from None


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # JSON string escapes are EBNF string escapes


def _literal(text: str) -> xgr.Grammar:
    import xgrammar as xgr
    return xgr.Grammar.from_ebnf(f"root ::= {_quoted(text)}")


def rename_root(ebnf: str, new_name: str) -> str:
    """`ebnf` with its rule `root` renamed (definition and references), leaving string literals and
    character classes alone."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (ebnf[j].isalnum() or ebnf[j] in "_-"):
                j += 1
            word = ebnf[i:j]
            out.append(new_name if word == "root" else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)
