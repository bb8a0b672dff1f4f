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


def test_the_experimental_switches_are_one_group_apart_from_the_settings():
    settings, experimental = render().split("### Experimental")
    assert {name for name, v in envs.VARIABLES.items() if f"| `{name}` |" in experimental} == \
        {name for name, v in envs.VARIABLES.items() if v.experimental}
    assert all(f"| `{name}` |" in settings for name, v in envs.VARIABLES.items() if not v.experimental)
    # an A/B switch is a measurement's, not a deployment's
    assert [name for name, v in envs.VARIABLES.items() if "A/B" in v.doc and not v.experimental] == []
