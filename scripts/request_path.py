"""The pagedllm files one `POST /v1/chat/completions` runs code in, per process of a real `pagedllm serve`.

    PYTHONPATH=$PWD python scripts/request_path.py                 # tables for a plain and a streamed request
    PYTHONPATH=$PWD python scripts/request_path.py --json path.json --markdown
    PYTHONPATH=$PWD python scripts/request_path.py --body '{"temperature": 0}'   # fields added to the request
    PYTHONPATH=$PWD python scripts/request_path.py -- --max-num-seqs 8   # after --: flags for `pagedllm serve`

It starts `pagedllm serve` (the embedded default model unless the flags after -- name another) with
scripts/request_path_hook.py installed as every server process's sitecustomize, sends one warm-up request
of each kind, then for each kind: SIGUSR1 to every hooked process of the server's tree (recording on),
the request, read to its end, SIGUSR2 (recording off, one JSON file per process). Then the same for an
idle window as long as the request's, so files that run without any request (timers, pollers) can be
told apart: they are marked "idle" in the tables.

A file counts as one "with logic" when at least one function written in it was entered (a call, or a
generator or coroutine resumed); a file entered only through methods dataclasses generate, or through
module or class bodies, holds data and is listed but not counted. Lines are the file's lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedllm.bench.subprocess_server import SubprocessServer, free_port, process_tree

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "pagedllm"
HOOK = Path(__file__).resolve().parent / "request_path_hook.py"
QUESTION = "What is the capital of France?"


def hooked_pids(server_pid: int, out_dir: Path) -> list[int]:
    """The server's processes that installed the hook (only they may be sent SIGUSR1/SIGUSR2)."""
    return [pid for pid in process_tree(server_pid) if (out_dir / f"ready.{pid}").exists()]


def wait_for(paths: list[Path], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from the hook: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.01)


def record(server_pid: int, out_dir: Path, action) -> tuple[dict[int, dict], float]:
    """Run ``action()`` with recording on in every hooked process; each process's record and the seconds."""
    pids = hooked_pids(server_pid, out_dir)
    for pid in pids:
        for stale in (out_dir / f"on.{pid}", out_dir / f"{pid}.json"):
            stale.unlink(missing_ok=True)
    for pid in list(pids):
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # exited since the tree was read (a short-lived child)
            pids.remove(pid)
    wait_for([out_dir / f"on.{pid}" for pid in pids])  # every process records before the request leaves
    start = time.monotonic()
    action()
    seconds = time.monotonic() - start
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    wait_for([out_dir / f"{pid}.json" for pid in pids])
    return {pid: json.loads((out_dir / f"{pid}.json").read_text()) for pid in pids}, seconds


def chat(url: str, model: str, stream: bool, max_tokens: int, extra: dict) -> str:
    """One chat completion, read to its end; the answer's text."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, **extra}
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def process_label(report: dict, server_pid: int) -> str:
    if report["pid"] == server_pid:
        return "API server"
    if report["process_name"] == "pagedllm-engine-core":
        return "engine core"
    if report["process_name"] != "MainProcess":
        return report["process_name"]
    return "python " + " ".join(report["command"][1:])[:70]  # e.g. multiprocessing's resource tracker


def summarize(reports: dict[int, dict], idle: dict[int, dict], server_pid: int, package: Path = PACKAGE) -> list[dict]:
    """Per process: its label and its files in order of first entry, each with its counts.

    A file's place is its first entry by a function the idle window did not enter: long-lived loops (the
    output handler, uvicorn's server) wake on their own timers and would otherwise head the list."""
    processes = []
    for pid, report in sorted(reports.items()):
        idle_files = idle.get(pid, {}).get("files", {})
        files = []
        for path, entry in report["files"].items():
            idle_names = set(idle_files.get(path, {}).get("functions", {}))
            ranks = {**entry["generated"], **entry["bodies"], **entry["functions"]}
            own = [rank for name, rank in entry["functions"].items() if name not in idle_names]
            files.append({
                "file": str(Path(path).relative_to(package)), "place": min(own or ranks.values()),
                "functions": len(entry["functions"]), "generated": len(entry["generated"]),
                "bodies": len(entry["bodies"]), "lines": len(Path(path).read_text().splitlines()),
                "logic": bool(entry["functions"]), "idle": path in idle_files, "names": sorted(entry["functions"]),
            })
        files.sort(key=lambda f: f["place"])
        processes.append({"pid": pid, "process": process_label(report, server_pid), "files": files})
    return processes


def totals(files: list[dict]) -> tuple[int, int, int]:
    logic = [f for f in files if f["logic"]]
    return len(logic), sum(f["functions"] for f in logic), sum(f["lines"] for f in logic)


def print_tables(kind: str, seconds: float, processes: list[dict], markdown: bool) -> None:
    print(f"\n## {kind} ({seconds:.2f} s)")
    row_format = "| {} | `{}` | {} | {} | {} |" if markdown else "{:>3} {:<48} {:>7} {:>6}  {}"
    union: dict[str, dict] = {}
    for proc in processes:
        if not proc["files"]:
            print(f"\n{proc['process']} (pid {proc['pid']}): no pagedllm code ran")
            continue
        print(f"\n{proc['process']} (pid {proc['pid']}), in order of first entry:\n")
        if markdown:
            print("| # | file | functions entered | lines | |\n|---|---|---|---|---|")
        for i, f in enumerate(proc["files"], 1):
            note = ", ".join(n for n, on in (("data only", not f["logic"]), ("idle too", f["idle"])) if on)
            row = (i, f["file"], f["functions"] if f["logic"] else f"0 (+{f['generated'] + f['bodies']})",
                   f["lines"], note)
            print(row_format.format(*row))
            union.setdefault(f["file"], f)
        num_files, num_functions, num_lines = totals(proc["files"])
        print(f"\n{proc['process']}: {num_files} files with logic, {num_functions} functions, {num_lines} lines")
    num_files, num_functions, num_lines = totals(list(union.values()))
    print(f"\nall processes: {num_files} distinct files with logic ({num_lines} lines); "
          f"{sum(not f['logic'] for f in union.values())} more holding data only")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--body", type=json.loads, default={},
                        help="a JSON object of request fields added to the chat request (default: none)")
    parser.add_argument("--json", type=Path, help="also write every process's files, with function names, here")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables")
    parser.add_argument("--keep", type=Path, help="keep the hook's raw files and the server log in this directory")
    parser.add_argument("serve_args", nargs="*", help="after --: flags for `pagedllm serve`")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="request-path-")) if args.keep is None else args.keep
    hook_dir, out_dir = work / "hook", work / "out"
    hook_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(HOOK, hook_dir / "sitecustomize.py")
    env = {"PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "REQUEST_PATH_OUT": str(out_dir), "REQUEST_PATH_PACKAGE": str(PACKAGE) + os.sep}
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           *args.serve_args]
    server = SubprocessServer(cmd, port, work / "serve.log", name="pagedllm serve", env=env, startup_timeout_s=900)
    results = {}
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        for kind, stream in (("non-streamed", False), ("streamed", True)):
            def one_request() -> str:
                return chat(server.url, model, stream, args.max_tokens, args.body)

            one_request()  # warm-up: lazy imports, first-call caches
            answers = []
            reports, seconds = record(server.proc.pid, out_dir, lambda: answers.append(one_request()))
            idle, _ = record(server.proc.pid, out_dir, lambda: time.sleep(seconds))
            processes = summarize(reports, idle, server.proc.pid)
            fields = ", ".join(f"{k}={v}" for k, v in {"max_tokens": args.max_tokens, **args.body}.items())
            print_tables(f"POST /v1/chat/completions, {kind}, {fields}", seconds, processes, args.markdown)
            print(f"(answer: {answers[0]!r})")
            results[kind] = {"seconds": seconds, "processes": processes}
    finally:
        server.stop()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
