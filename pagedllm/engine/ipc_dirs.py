"""The private directories that hold a front end's ipc sockets to its engine core.

Each is `$TMPDIR/pagedllm-ipc-XXXXXXXX` (mode 0700) with an `owners` file naming the pids of the
front end and its core. A directory is stale, and removed when the next engine starts, only when
all of this holds: it is ours (this user's, a directory, not a link), it has our name pattern and an
owners file, and no pid listed there is alive. Anything else is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile

logger = logging.getLogger(__name__)

IPC_DIR_PREFIX = "pagedllm-ipc-"
OWNERS_FILE = "owners"


def make_ipc_dir() -> str:
    """A new private directory for one engine's sockets, owned by this process until `set_owners`."""
    path = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
    os.chmod(path, 0o700)
    set_owners(path, [os.getpid()])
    return path


def set_owners(path: str, pids: list[int]) -> None:
    """Record the processes whose life keeps `path` in use (written atomically)."""
    tmp = os.path.join(path, OWNERS_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(" ".join(str(p) for p in pids))
    os.replace(tmp, os.path.join(path, OWNERS_FILE))


def ipc_dir_of(address: str) -> str | None:
    """The socket directory of an `ipc://DIR/name` address made by `make_ipc_dir`; None otherwise."""
    if not address.startswith("ipc://"):
        return None
    path = os.path.dirname(address[len("ipc://"):])
    return path if os.path.basename(path).startswith(IPC_DIR_PREFIX) else None


def remove_ipc_dir(path: str) -> None:
    """Remove one socket directory if it is ours (name pattern, owner, a real directory)."""
    if _is_ours(path):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove the socket directories of engines that are gone; returns the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(IPC_DIR_PREFIX):
            continue
        path = os.path.join(root, name)
        pids = _owners(path) if _is_ours(path) else None
        if pids and not any(_is_alive(pid) for pid in pids):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d stale engine socket director%s", len(removed), "y" if len(removed) == 1 else "ies")
    return removed


def _is_ours(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and os.path.basename(os.path.normpath(path)).startswith(IPC_DIR_PREFIX))


def _owners(path: str) -> list[int] | None:
    """The pids in the owners file; None when it is missing or unreadable (then the dir is not provably stale)."""
    try:
        with open(os.path.join(path, OWNERS_FILE)) as f:
            pids = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return None
    return pids if pids and all(p > 0 for p in pids) else None


def _is_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone); when unsure, alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: the pid is in use
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
