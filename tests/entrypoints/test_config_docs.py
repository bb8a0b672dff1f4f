"""docs/configuration.md is what the generator prints from the code, so it cannot drift from the flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedllm import envs
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.config_docs import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_page_is_what_the_generator_prints():
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m pagedllm.entrypoints.config_docs > docs/configuration.md`")


def test_every_flag_of_every_command_and_every_variable_is_on_the_page():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    page = render()
    options = {o for name in ("serve", "generate", "chat", "worker") for a in commands[name]._actions
               if a.help != argparse.SUPPRESS for o in a.option_strings if o not in ("-h", "--help")}
    assert {"--max-model-len", "--kv-cache-memory", "--api-key", "-tp", "--temperature"} <= options
    assert sorted(o for o in options if f"`{o}`" not in page) == []
    assert sorted(name for name in envs.VARIABLES if f"| `{name}` |" not in page) == []
