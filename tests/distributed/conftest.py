"""Shared by the tensor-parallel tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Like the workers: on a busy 2-core machine the test process's extra intra-op threads only contend with
    the ranks' (~5x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
