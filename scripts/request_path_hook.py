"""Which pagedllm files run code in a window, per process: scripts/request_path.py copies this file as
`sitecustomize.py` into a directory it puts first on the server's PYTHONPATH, so every Python process of
the server (the API process, the spawned engine core) imports it at start-up.

When REQUEST_PATH_OUT names a directory, it installs a profile function (sys.setprofile for this thread,
threading.setprofile for threads started later) and two signal handlers:

    SIGUSR1   forget what was recorded, start recording, write OUT/on.<pid>
    SIGUSR2   stop recording, write what was recorded to OUT/<pid>.json

and writes OUT/ready.<pid> so the tool knows which processes may be sent those signals (an unhooked
process would die of them). While recording, each "call" event (a function entered, or a generator or
coroutine resumed) whose code lies under REQUEST_PATH_PACKAGE is kept: per file, the qualified names
entered, each with its rank in the process's order of first entries. Methods that dataclasses generate
(their code's file is "<string>") are kept under the module whose globals they run in, as "generated":
a file entered only that way holds data, not logic. Module and class bodies are kept apart as "bodies"
for the same reason.

Standard library only, and nothing runs while recording is off but one test per event.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import threading

_OUT = os.environ.get("REQUEST_PATH_OUT")
_PACKAGE = os.environ.get("REQUEST_PATH_PACKAGE", "")
_recording = False
_next_order = 0
_files: dict[str, dict[str, dict[str, int]]] = {}  # file -> kind -> qualified name -> rank of first entry


def _record(frame, event, arg):
    global _next_order
    if not _recording or event != "call":
        return
    code = frame.f_code
    path = code.co_filename
    if path.startswith(_PACKAGE):
        kind = "functions" if code.co_flags & inspect.CO_OPTIMIZED else "bodies"
        name = code.co_qualname
    elif path.startswith("<"):
        module = sys.modules.get(frame.f_globals.get("__name__", ""))
        path = getattr(module, "__file__", None) or ""
        if not path.startswith(_PACKAGE):
            return
        kind = "generated"
        owner = frame.f_locals.get("self")  # the generated code's own qualname is "__create_fn__.<locals>.…"
        name = f"{type(owner).__qualname__}.{code.co_name}" if owner is not None else code.co_name
    else:
        return
    entry = _files.get(path)
    if entry is None:
        entry = _files[path] = {"functions": {}, "generated": {}, "bodies": {}}
    if name not in entry[kind]:
        entry[kind][name] = _next_order
        _next_order += 1


def _write(name: str, text: str) -> None:
    # Written whole, then renamed: the tool polls for the name and must never read half a file.
    tmp = os.path.join(_OUT, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(_OUT, name))


def _start(signum, frame) -> None:
    global _recording, _next_order
    _files.clear()
    _next_order = 0
    _recording = True
    _write(f"on.{os.getpid()}", "")


def _dump(signum, frame) -> None:
    global _recording
    _recording = False
    import multiprocessing

    report = {"pid": os.getpid(), "process_name": multiprocessing.current_process().name, "command": sys.orig_argv,
              "files": _files}
    _write(f"{os.getpid()}.json", json.dumps(report, indent=1))


if _OUT and _PACKAGE:
    threading.setprofile(_record)
    sys.setprofile(_record)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
    _write(f"ready.{os.getpid()}", "")
