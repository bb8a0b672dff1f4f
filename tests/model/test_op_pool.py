"""The compiled ops' own worker threads (csrc/thread_pool.cpp) against torch's OpenMP threads.

Each op must give the same bits whichever threads run it and however many there are (every
range of a split runs exactly once), the pool must take the jobs it is given (its counters
move), a worker that slept must wake for the next job, a child of fork() must get working
threads of its own, and the workers must stop spinning while other processes want the cores, handing
their jobs to OpenMP meanwhile.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pagedllm.model.attention import cpu_op
from pagedllm.model.layers import cpu_gemm
from tests.model.conftest import require_compiled_cpu_ops
from tests.model.test_cpu_attention import random_case


@pytest.fixture(autouse=True)
def pool_state():
    require_compiled_cpu_ops()
    before = cpu_op.op_pool()
    threads = torch.get_num_threads()
    # the workers' own tests: a busy test machine must not send their jobs to OpenMP
    cpu_op.op_pool(yield_when_contended=False)
    yield
    torch.set_num_threads(threads)
    cpu_op.op_pool(enabled=before["enabled"], spin_us=before["spin_us"],
                   yield_when_contended=before["yield_when_contended"])


def gemm_case(rows: int, k: int = 96, n: int = 200, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = cpu_gemm.pack(w)
    if packed is None:
        pytest.skip("no compiled GEMM on this CPU")
    return lambda: cpu_gemm.gemm(x, packed, b, n)


def attention_case():
    # 7 decode rows, a prompt chunk over a cached prefix, and a long single row that splits.
    query, kv_cache, metadata, scale = random_case([70, 90, 3000, 66, 49, 33, 17, 120, 5],
                                                    [1, 1, 1, 1, 1, 1, 1, 40, 1], seed=3)
    return lambda: cpu_op.paged_attention_cpu(query, kv_cache, metadata, scale)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_same_bits_on_the_pool_and_on_openmp(threads):
    torch.set_num_threads(threads)
    for run in (gemm_case(1), gemm_case(13), gemm_case(64), attention_case()):
        cpu_op.op_pool(enabled=False)
        expected = run()
        cpu_op.op_pool(enabled=True)
        jobs = cpu_op.op_pool()["jobs"]
        for _ in range(3):
            torch.testing.assert_close(run(), expected, atol=0, rtol=0)
        if threads > 1:
            assert cpu_op.op_pool()["jobs"] > jobs, "the ops ran without the pool"


def test_thread_count_changes_between_jobs():
    run = gemm_case(16)
    expected = run()
    for threads in (2, 4, 1, 3, 2):
        torch.set_num_threads(threads)
        torch.testing.assert_close(run(), expected, atol=0, rtol=0)


def test_workers_that_slept_wake_for_the_next_job():
    torch.set_num_threads(2)
    run = attention_case()
    expected = run()
    cpu_op.op_pool(enabled=True, spin_us=0)  # never spin: every wait sleeps on the futex
    sleeps = cpu_op.op_pool()["worker_sleeps"]
    for _ in range(20):
        torch.testing.assert_close(run(), expected, atol=0, rtol=0)
    assert cpu_op.op_pool()["worker_sleeps"] > sleeps


def test_a_forked_child_gets_its_own_workers():
    torch.set_num_threads(2)
    run = gemm_case(24)
    expected = run()  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker threads were not copied
        code = 1
        signal.alarm(60)  # a child that hangs dies of SIGALRM and fails the test
        try:
            jobs = cpu_op.op_pool(yield_when_contended=False)["jobs"]  # a fresh pool: its own settings
            ok = all(torch.equal(run(), expected) for _ in range(3))
            code = 0 if ok and cpu_op.op_pool()["jobs"] > jobs else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_workers_stop_spinning_while_other_processes_want_the_cores():
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no schedstat here: the pool stays passive (never spins)")
    torch.set_num_threads(2)
    cpu_op.op_pool(enabled=True, spin_us=50, yield_when_contended=True)
    run = gemm_case(64, k=512, n=2048)
    expected = run()
    windows = cpu_op.op_pool()["contended_windows"]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and cpu_op.op_pool()["contended_windows"] == windows:
            run()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    state = cpu_op.op_pool()
    assert state["contended_windows"] > windows, "busy cores were not noticed"
    assert state["contended"], "the pool went back to spinning while the cores were busy"
    # meanwhile its jobs go to OpenMP, with the same bits
    torch.testing.assert_close(run(), expected, atol=0, rtol=0)
    assert cpu_op.op_pool()["handed_off"] > state["handed_off"], "a job of a contended pool was not handed off"
