"""The map of docs/design.md, enforced on the source (ast), file by file: every import points down the layers, and no
modules import each other in a circle.

Imports inside functions count like the others: a lazy import hides a circle from Python at import time, not from the
design (the two modules still cannot be understood, tested or moved apart). So do imports under ``TYPE_CHECKING``. The
few deliberate exceptions are edges named in ``ALLOWED``, each with its reason. And no file passes 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"

LAYERS = (
    # Top to bottom. A file imports only from layers below its own: never from its layer's neighbours in the same
    # row, never from above. A place is a package (its folder) or a file; a file's place is the longest that holds it.
    ("bench",),  # benchmarks and their baselines, through public surfaces
    ("__init__.py",),  # the package's front door: `from pagedllm import LLM, SamplingParams`
    ("entrypoints",),  # people: LLM (offline), the CLI, the OpenAI-compatible server
    ("engine",),  # front ends, core clients, EngineCore (scheduler + executor)
    ("worker", "metrics"),  # execution; serving metrics (a sink: fed plain stats, imports no engine)
    ("lora",),  # adapters: PEFT loading, slots on the linears, the worker's manager
    ("core", "model", "structured"),  # decisions (pure Python); torch networks; grammars for structured output
    ("distributed",),  # the tensor-parallel group and its collectives
    ("config",),  # frozen configs, EngineArgs, flags
    ("sampling_params.py", "pooling_params.py", "outputs.py", "lora/request.py"),  # plain data every layer passes
    ("errors.py", "envs.py", "request_limits.py", "version.py"),  # typed errors; switches; request ceilings; release
)

SKIPPED = {
    # Besides the order: the server and the CLI reach execution through the engine, never around it.
    "entrypoints": ("worker",),
}

THIRD_PARTY = {
    # core/ decides: no tensors.
    "core": ("torch",),
    # engine/ knows no HTTP.
    "engine": ("fastapi", "starlette", "uvicorn"),
}

ALLOWED = {
    # `pagedllm bench ...` is a subcommand of the one CLI; the import is lazy, inside that command.
    "entrypoints/cli.py -> bench/cli.py",
    # `pagedllm worker` is a tensor-parallel rank's process (multi-host): the CLI hands that process to its main.
    "entrypoints/cli.py -> worker/tp_worker.py",
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_modules(path: Path, package: list[str] = ()) -> set[str]:
    """Every module ``path`` imports (at any depth: functions, ``if``, ``try``), as written: ``from a import b``
    gives ``a.b`` (which may name a module or a name in ``a``); relative imports are resolved from ``package``."""
    package = list(package)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from a import b`` counts as ``a.b`` where that is a module,
    else as ``a``; the parent packages that Python also runs on the way are not counted as edges)."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        targets = set()
        parts = module.split(".")
        for name in imported_modules(path, parts if path.name == "__init__.py" else parts[:-1]):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def place_of(module: str, files: dict[str, Path]) -> str:
    rel = files[module].relative_to(PACKAGE).as_posix()
    places = [p for row in LAYERS for p in row if rel == p or rel.startswith(p + "/")]
    return max(places, key=len) if places else f"(no place: {rel})"


def rank_of(place: str) -> int | None:
    return next((i for i, row in enumerate(LAYERS) if place in row), None)


def points_up(here: str, there: str) -> bool:
    """Whether an import from place ``here`` of place ``there`` goes up or sideways, or skips a layer it must go
    through (within a place is free)."""
    return here != there and (rank_of(there) <= rank_of(here) or there in SKIPPED.get(here, ()))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def one_cycle(component: list[str], graph: dict[str, set[str]]) -> str:
    """A readable path a -> b -> ... -> a through ``component`` (breadth-first, so the shortest from its first)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return " -> ".join([start] + path[::-1][1:] + [start])
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not a circle")


def edge_name(a: str, b: str, files: dict[str, Path]) -> str:
    return f"{files[a].relative_to(PACKAGE).as_posix()} -> {files[b].relative_to(PACKAGE).as_posix()}"


def test_every_file_has_a_place():
    files = module_files()
    assert sorted(p for m in files if rank_of(p := place_of(m, files)) is None) == []


def test_no_import_circles():
    """Over every edge, the ALLOWED ones included: an exception to the order is never one to this."""
    graph = import_graph()
    found = [f"circle of {', '.join(c)} (e.g. {one_cycle(c, graph)})" for c in circles(graph)]
    assert found == []


def test_imports_point_down():
    files = module_files()
    upward = []
    for module, targets in import_graph().items():
        here = place_of(module, files)
        for target in targets:
            there = place_of(target, files)
            if points_up(here, there) and edge_name(module, target, files) not in ALLOWED:
                upward.append(f"{edge_name(module, target, files)} ({here} may not import {there})")
    assert sorted(upward) == []


@pytest.mark.parametrize("layer", sorted(THIRD_PARTY))
def test_layer_imports_no_forbidden_library(layer):
    forbidden = THIRD_PARTY[layer]
    found = sorted(f"{path.relative_to(PACKAGE)}: {name}" for path in (PACKAGE / layer).rglob("*.py")
                   for name in imported_modules(path)
                   if any(name == f or name.startswith(f + ".") for f in forbidden))
    assert found == []


def test_allowed_edges_exist():
    """An exception outlives its import only by mistake: each must still be an edge of the graph."""
    files = module_files()
    edges = {edge_name(m, t, files) for m, targets in import_graph().items() for t in targets}
    assert sorted(ALLOWED - edges) == []


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from pagedllm.engine.core import EngineCore\n"
                   "if True:\n    from ..metrics import prometheus\n")
    assert imported_modules(bad, ["pagedllm", "model"]) == {"pagedllm.engine.core.EngineCore",
                                                              "pagedllm.metrics.prometheus"}
    assert points_up("model", "engine") and points_up("worker", "metrics") and points_up("core", "model")
    assert points_up("entrypoints", "worker")
    assert not points_up("engine", "model") and not points_up("model", "model")


def test_the_checker_finds_a_circle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert one_cycle(["a", "b", "c"], graph) == "a -> b -> c -> a"
    assert circles({"x": {"y"}, "y": set()}) == []


MAX_FILE_LINES = 400
"""No file of the package is longer: one grown past it is split by responsibility (docs/design.md's file map)."""


def files_over(root: Path, max_lines: int) -> list[str]:
    """``path: lines`` of every .py file under ``root`` longer than ``max_lines``, longest first."""
    counted = [(len(path.read_text().splitlines()), path.relative_to(root).as_posix()) for path in root.rglob("*.py")]
    return [f"{name}: {n}" for n, name in sorted(counted, reverse=True) if n > max_lines]


def test_no_file_passes_400_lines():
    assert files_over(PACKAGE, MAX_FILE_LINES) == []


def test_the_line_count_sees_a_long_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 401)
    (tmp_path / "short.py").write_text("x = 1\n" * 400)
    assert files_over(tmp_path, 400) == ["sub/long.py: 401"]


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
