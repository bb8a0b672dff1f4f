"""scripts/request_path.py's hook and counting, on a two-file package in a child Python (no server)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPTS = REPO / "scripts"

LOGIC = '''
import threading
from pkg.data import Point

def before():
    return 1

def walk(n):
    for i in range(n):
        yield i

def in_thread():
    Point(3, 4)

def during(gen):
    next(gen)                  # resumes a generator started before the window
    Point(1, 2)                # a dataclass's generated __init__: data, not logic
    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
'''

DATA = '''
from dataclasses import dataclass

@dataclass
class Point:
    x: int
    y: int
'''

CHILD = '''
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from pkg import logic
gen = logic.walk(3)
next(gen)
logic.before()                       # before SIGUSR1: not recorded
os.kill(os.getpid(), signal.SIGUSR1)
logic.during(gen)
os.kill(os.getpid(), signal.SIGUSR2)
logic.before()                       # after SIGUSR2: not recorded
'''


def load_tool():
    spec = importlib.util.spec_from_file_location("request_path", SCRIPTS / "request_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_records_functions_entered_in_the_window_and_the_tool_counts_files_with_logic(tmp_path):
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "logic.py").write_text(LOGIC)
    (package / "data.py").write_text(DATA)
    hook_dir, out = tmp_path / "hook", tmp_path / "out"
    hook_dir.mkdir()
    out.mkdir()
    shutil.copy(SCRIPTS / "request_path_hook.py", hook_dir / "sitecustomize.py")
    env = {**os.environ, "PYTHONPATH": str(hook_dir), "REQUEST_PATH_OUT": str(out),
           "REQUEST_PATH_PACKAGE": str(package) + os.sep}
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "src")], env=env,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    pid = int(next(out.glob("ready.*")).name.split(".")[1])
    report = json.loads((out / f"{pid}.json").read_text())

    files = report["files"]
    logic, data = str(package / "logic.py"), str(package / "data.py")
    assert set(files) == {logic, data}
    # Ranks of first entry: not `before` (outside the window); `walk` resumed; `in_thread` in another thread.
    assert files[logic] == {"functions": {"during": 0, "walk": 1, "in_thread": 3}, "generated": {}, "bodies": {}}
    assert files[data] == {"functions": {}, "generated": {"Point.__init__": 2}, "bodies": {}}

    tool = load_tool()
    [proc] = tool.summarize({pid: report}, {}, server_pid=pid, package=package)
    assert proc["process"] == "API server"
    assert [(f["file"], f["functions"], f["logic"], f["idle"]) for f in proc["files"]] == [
        ("logic.py", 3, True, False), ("data.py", 0, False, False)]
    assert tool.totals(proc["files"]) == (1, 3, len(LOGIC.splitlines()))

    # Functions an idle window entered too do not place their file: logic.py's first own entry is then
    # `in_thread` (3), after data.py's (2).
    idle = {pid: {"files": {logic: {"functions": {"during": 0, "walk": 1}, "generated": {}, "bodies": {}}}}}
    [proc] = tool.summarize({pid: report}, idle, server_pid=pid, package=package)
    assert [(f["file"], f["idle"]) for f in proc["files"]] == [("data.py", False), ("logic.py", True)]
