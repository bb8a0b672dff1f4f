"""Imports only point down the layers of docs/design.md: checked on the source, file by file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"

FORBIDDEN = {
    # core/ decides: no tensors, nothing above it.
    "core": ("torch", "pagedllm.worker", "pagedllm.model", "pagedllm.engine", "pagedllm.entrypoints",
             "pagedllm.bench", "pagedllm.distributed"),
    # engine/ joins core and worker and knows no HTTP.
    "engine": ("pagedllm.entrypoints", "pagedllm.bench", "fastapi", "starlette", "uvicorn"),
    # model/ knows no requests and no scheduling.
    "model": ("pagedllm.core", "pagedllm.engine", "pagedllm.worker", "pagedllm.entrypoints", "pagedllm.bench"),
    # worker/ executes what it is told; it does not reach up to the engine or the people-facing side.
    "worker": ("pagedllm.engine", "pagedllm.entrypoints", "pagedllm.bench"),
    # The product never imports its benchmarks (but see ALLOWED).
    "entrypoints": ("pagedllm.bench",),
    "distributed": ("pagedllm.core", "pagedllm.engine", "pagedllm.entrypoints", "pagedllm.bench"),
    # metrics/ reads the engine's stats messages; the server reads metrics, not the other way.
    "metrics": ("pagedllm.entrypoints", "pagedllm.bench"),
}

ALLOWED = {
    # `pagedllm bench ...` is a subcommand of the one CLI; the import is lazy, inside that command.
    "entrypoints/cli.py: pagedllm.bench.cli",
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_point_down(layer):
    forbidden = FORBIDDEN[layer]
    found = sorted(f"{path.relative_to(PACKAGE)}: {name}" for path in (PACKAGE / layer).rglob("*.py")
                   for name in imported_modules(path)
                   if any(name == f or name.startswith(f + ".") for f in forbidden))
    assert [f for f in found if f not in ALLOWED] == []


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from pagedllm.engine.core import EngineCore\n")
    assert "pagedllm.engine.core" in imported_modules(bad)


def test_the_api_server_module_imports_no_grammar_engine():
    """xgrammar (and the torch it pulls in, ~3 s and ~220 MB) waits for the first request that needs a
    grammar; importing the API server must not load it. Checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys, pagedllm.entrypoints.openai.api_server; "
            "print(sorted(m for m in ('xgrammar', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"
