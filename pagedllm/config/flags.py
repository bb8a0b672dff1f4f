"""Command-line flags generated from dataclass fields, so that each setting is declared once.

A field's default is its flag's default; its docstring (the string under it, or under the field of
the config that owns it: `metadata["owner"]`) is its flag's help, unless `flag(help=...)` gives one; `flag()` adds what a type cannot say (choices, aliases, a parser,
the --help section). `check_choices` validates the declared choices, so the flag and the dataclass
refuse the same values.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_memory_size(value: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain integers are bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read a memory size from {value!r}; use e.g. 2GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_token_count(value: str | int) -> int:
    """A token count as vLLM's --max-model-len reads it: '32k' -> 32000, '25.6k' -> 25600, '1K' -> 1024, '2048'."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgKMG]?)\s*", value)
    if not match:
        raise ValueError(f"cannot read a token count from {value!r}; use e.g. 4096, 32k (32000) or 32K (32768)")
    number, suffix = match.groups()
    if suffix in _BINARY_SUFFIXES:
        if "." in number:
            raise ValueError(f"{value!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
                             f"{number}{suffix.lower()}?")
        return int(number) * _BINARY_SUFFIXES[suffix]
    if "." in number and not suffix:
        raise ValueError(f"a token count is a whole number, got {value!r}")
    return int(round(float(number) * _DECIMAL_SUFFIXES.get(suffix, 1)))


def _parse_bool(value: str | bool) -> bool:
    """'true'/'1'/'yes' or 'false'/'0'/'no' (so every engine flag can be passed as --flag VALUE)."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def flag(default, help: str | None = None, *, aliases: tuple[str, ...] = (), choices: tuple | None = None,
         parse=None, group: str | None = None, negative: str | None = None, secret: bool = False):
    """A dataclass field whose command-line flag is declared beside it; `add_flags` reads it.

    help: the flag's help (default: the field's docstring); aliases: more spellings (e.g. "-tp");
    choices: the values allowed (checked by argparse and by `check_choices`); parse: turns the flag's
    text into the value (e.g. a size); group: the --help section; negative: a bool's switch-off flag
    (e.g. "--no-prefix-caching"); secret: kept out of the dataclass's repr (and so out of logs).
    A field that must not become a flag carries `metadata={"cli": False}` instead.
    """
    metadata = {"help": help, "aliases": aliases, "choices": choices, "parse": parse, "group": group,
                "negative": negative}
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of class `cls` (whitespace folded to one line), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # a builtin, or source not on disk
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, doc in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
                docs[node.target.id] = " ".join(doc.value.value.split())
    return docs


def check_choices(config) -> None:
    """Raise ValueError naming the field when a field declared with `flag(choices=...)` holds another value.
    A field that a `setting()` copied from a runtime config is left to that config (checked once, there)."""
    for f in dataclasses.fields(config):
        choices = None if "owner" in f.metadata else f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")


_FLAG_TYPES = (bool, int, float, str)


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One `--field-name` flag per field of dataclass `cls` whose type the command line can express
    (bool, int, float, str, their Optionals and Literals, or any type with a `parse` in its metadata).

    Defaults come from the fields, so each is declared once; a bool flag takes an optional value
    (`--flag`, `--flag false`).
    """
    hints = typing.get_type_hints(cls)
    groups: dict = {}  # title -> argparse group
    for f in dataclasses.fields(cls):
        meta = f.metadata
        flag_type, choices = _flag_type(hints[f.name])
        parse = meta.get("parse") or flag_type
        if parse is None or meta.get("cli") is False:
            continue  # not expressible as text (an object passed in code), or set elsewhere
        choices = meta.get("choices") or choices
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        group = meta.get("group")
        if group is not None and group not in groups:
            groups[group] = parser.add_argument_group(group)
        target = groups[group] if group is not None else parser
        doc = field_docs(meta.get("owner", cls)).get(f.name, "")  # a setting's owner documents it
        help_text = (meta.get("help") or doc).replace("%", "%%")  # argparse formats help with %
        if default is not None and default != "":
            help_text += f" (default: {_format_default(default, parse)})"
        names = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        if parse is bool:
            target.add_argument(*names, dest=f.name, nargs="?", const=True, default=default, type=_parse_bool,
                                metavar="BOOL", help=help_text)
            if meta.get("negative"):
                target.add_argument(meta["negative"], dest=f.name, action="store_false", default=default,
                                    help=f"same as {names[0]} false")
        else:
            target.add_argument(*names, dest=f.name, type=_flag_parser(parse), default=default,
                                choices=choices, help=help_text)


def _flag_type(hint) -> tuple[type | None, tuple | None]:
    """The flag type of a field's type hint (Optional stripped), and a Literal's choices; None when unsupported."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0]), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        return (members[0] if len(members) == 1 and members[0] in _FLAG_TYPES else None), None
    return (hint if hint in _FLAG_TYPES else None), None


def _format_default(default, parse) -> str:
    """A default as a user would type it: sizes in MiB/GiB rather than bytes."""
    if parse is parse_memory_size and isinstance(default, int):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
            if default >= size and default % size == 0:
                return f"{default // size}{unit}"
    return str(default).lower() if isinstance(default, bool) else str(default)


def _flag_parser(parse):
    """`parse`, with its ValueError shown by argparse as the flag's error message."""
    if parse in _FLAG_TYPES:
        return parse

    def parse_flag(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_flag
