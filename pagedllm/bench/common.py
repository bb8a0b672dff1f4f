"""What every benchmark shares: machine description, result files, timers."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(out_dir: str | Path, name: str, result: dict) -> Path:
    """Write `result` (plus the machine description) to OUT/NAME.json; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "machine": machine_info(), **result}
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    return path


def format_table(headers: list[str], rows: list[list], floatfmt: str = "{:.2f}") -> str:
    """A GitHub-markdown table."""
    def cell(v):
        if isinstance(v, float):
            return floatfmt.format(v)
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@contextmanager
def timer():
    """with timer() as t: ...; t() -> seconds elapsed (frozen at exit)."""
    start = time.perf_counter()
    end = None

    def elapsed() -> float:
        return (end if end is not None else time.perf_counter()) - start

    try:
        yield elapsed
    finally:
        end = time.perf_counter()


def best_time(fn, repeats: int, warmup: bool = True) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one untimed call): the machine's other load
    only ever adds time, so the minimum is the closest reading of the cost itself."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_subparser(subparsers, name: str, run, help: str, engine: bool = True):
    """The parser of `pagedllm bench NAME`, with what every benchmark takes (--out, --no-progress and, for
    one that runs an engine, every engine flag); `run(args, engine_args)` runs it. Each benchmark declares
    its own arguments on the parser this returns, in the function its module calls `add_parser`."""
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser(name, help=help)
    p.add_argument("--out", default="bench_results", help="directory for JSON results and PNG plots")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    if engine:
        EngineArgs.add_cli_args(p)
    p.set_defaults(run=run)
    return p


def int_list(text: str) -> list[int]:
    """'1,16,64' -> [1, 16, 64] (a comma-separated flag)."""
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    """'0.5,1,inf' -> [0.5, 1.0, inf] (a comma-separated flag)."""
    return [float(x) for x in text.split(",") if x]
