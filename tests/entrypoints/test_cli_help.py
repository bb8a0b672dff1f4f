"""Every subcommand's --help works (a '%' in a help string once crashed `pagedllm bench --help`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import build_parser
from tests.entrypoints.server_helpers import REPO_ROOT


def _command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser tree: (), ("serve",), ("bench", "prefix"), ..."""
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.extend(_command_paths(sub, (*prefix, name)))
    return paths


COMMANDS = _command_paths(build_parser())


def test_the_tree_holds_every_subcommand():
    names = {path[0] for path in COMMANDS if path}
    assert {"generate", "chat", "serve", "bench", "worker"} <= names
    assert sum(1 for path in COMMANDS if path[:1] == ("bench",)) > 5


@pytest.mark.parametrize("path", COMMANDS, ids=[" ".join(p) or "pagedllm" for p in COMMANDS])
def test_help_works(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        build_parser().parse_args([*path, "--help"])
    assert info.value.code == 0
    assert out.getvalue().startswith("usage:") and len(out.getvalue()) > 100


def test_bench_help_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "--help"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "0% hit" in r.stdout  # the escaped '%' is shown as one
