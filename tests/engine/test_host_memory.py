"""glibc's malloc as the processes that run a model set it (worker/host_memory.py): mid-sized buffers are
mapped, so their pages go back at free, also after glibc's own threshold would have risen past them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm.engine.core_client import MPCoreClient
from pagedllm.worker import host_memory
from tests.engine.test_core_client import engine_args  # noqa: F401 - the tiny model's fixture

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory._glibc() is None,
                                reason="glibc only")

# In a fresh interpreter: free a 24 MiB mapped block (glibc's dynamic threshold rises to 24 MiB), then
# take 6 MiB and print whether it was mapped (mallinfo2's count of mapped blocks went up).
_PROBE = textwrap.dedent("""
    import ctypes
    from pagedllm.worker import host_memory
    configured = host_memory.configure_malloc()
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(24 << 20))
    before = libc.mallinfo2().hblks
    block = libc.malloc(6 << 20)
    print(configured, libc.mallinfo2().hblks - before)
    libc.free(block)
""")


def _probe(**env: str) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout.split()


def test_configured_malloc_maps_a_buffer_glibc_would_keep_in_its_heap():
    assert _probe() == ["True", "1"]
    assert _probe(PAGEDLLM_DISABLE_MALLOC_TUNING="1") == ["False", "0"]  # glibc's default: the heap


def test_the_engine_core_process_sets_it(engine_args, capfd):  # noqa: F811
    async def scenario():
        client = MPCoreClient(engine_args, log_level="INFO")
        try:
            await client.wait_ready()
        finally:
            client.shutdown()

    asyncio.run(scenario())
    assert f"malloc: buffers of {host_memory.MMAP_THRESHOLD >> 20} MiB and more are mapped" in capfd.readouterr().err
