"""`pagedllm bench`: each benchmark declares its own parser; `bench all` parses its arguments with those
parsers (no copied defaults to drift), and refuses a size naming an argument its benchmark lacks."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import pagedllm.bench.cli as bench_cli
from pagedllm.bench import cli_fast_path, cli_memory, cli_throughput
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser
from tests.entrypoints.server_helpers import REPO_ROOT

RUN_BY_ALL = {cli_throughput: ("throughput", "serving"), cli_memory: ("memory", "sharing", "prefix", "preemption"),
              cli_fast_path: ("roofline", "profile", "attention")}


def test_every_benchmark_is_declared_by_its_module_with_the_function_that_runs_it():
    parsers = bench_cli.benchmark_parsers()
    assert len(parsers) == 25 and {"throughput", "agent-apis", "embed", "embed-mixed", "kv-disk", "hardening",
                                   "speculative", "attention", "moe", "accuracy", "llamacpp",
                                   "serve-memory", "quant-gemm", "bf16-error"} <= set(parsers)
    for name, parser in parsers.items():
        run = parser.get_default("run")
        assert callable(run) and run.__name__ == "bench_" + name.replace("-", "_"), name
        assert parser.get_default("out") == "bench_results"
    for module in bench_cli.BENCHMARK_MODULES:
        assert callable(importlib.import_module(module).add_parser)


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Run `bench all` with every benchmark replaced by a recorder: [(name, args, engine_args)]."""
    calls = []
    for module, names in RUN_BY_ALL.items():
        for name in names:
            def record(args, engine_args=None, name=name):
                calls.append((name, args, engine_args))
                return {"systems": [{}]}
            monkeypatch.setattr(module, f"bench_{name}", record)

    def run(*argv):
        calls.clear()
        args = build_parser().parse_args(["bench", "all", "--out", str(tmp_path), *argv])
        bench_cli.bench_all(args, dict(vars(EngineArgs.from_cli_args(args))))
        return calls

    return run


@pytest.mark.parametrize("smoke", [False, True])
def test_bench_all_gives_each_benchmark_its_own_parsers_defaults_plus_its_sizes(recorded, smoke, tmp_path):
    calls = recorded("--max-num-seqs", "16", "--no-progress", *(["--smoke"] if smoke else []))
    names = [name for name, _, _ in calls]
    assert set(names) == {n for ns in RUN_BY_ALL.values() for n in ns} - ({"sharing"} if smoke else set())
    parsers = bench_cli.benchmark_parsers()
    sizes = bench_cli.smoke_sizes() if smoke else bench_cli.ALL_SIZES["full"]
    entries = {"throughput": list(sizes["throughput"]), "memory": [sizes["memory"], sizes["memory_sharegpt"]]}
    for name, args, engine_args in calls:
        defaults = vars(parsers[name].parse_args([]))
        assert set(vars(args)) == set(defaults), name  # exactly its own arguments
        assert args.out == str(tmp_path) and args.progress is False
        given = set(entries[name].pop(0) if name in entries else sizes[name])  # the sizes of this very run
        for key, value in defaults.items():
            if key not in given | {"out", "progress", "max_num_seqs"}:
                assert getattr(args, key) == value, f"bench all changed {name}'s {key}"
        if name == "attention":
            assert engine_args is None and not hasattr(args, "max_num_seqs")  # no engine: none of its flags
        else:
            assert engine_args["max_num_seqs"] == args.max_num_seqs == 16
    roofline = next(args for name, args, _ in calls if name == "roofline")
    assert roofline.decode_steps == sizes["roofline"]["decode_steps"] != parsers["roofline"].get_default("decode_steps")


def test_a_size_naming_an_argument_the_benchmark_lacks_is_refused(recorded, monkeypatch):
    monkeypatch.setitem(bench_cli.ALL_SIZES["full"], "roofline", dict(batch_sizes="1", prompt_length=8))
    with pytest.raises(ValueError, match="`bench roofline` has no argument prompt_length"):
        recorded()


def test_declaring_the_benchmarks_imports_no_torch():
    """Why throughput's or roofline's parser is not in throughput.py or roofline.py: those import torch,
    and `pagedllm --help` (or `serve`) should not wait for it."""
    code = ("import sys; from pagedllm.bench.cli import benchmark_parsers; benchmark_parsers(); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
