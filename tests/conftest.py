"""Suite-wide setup."""

import os

# Before any test module imports torch: see pagedllm/__init__.py (spinning OpenMP threads
# make every op fight for the cores when test, server and engine processes run together).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    # `slow` (subprocess servers and the like) is registered in pyproject.toml once that lands; until then here
    if not any(line.startswith("slow:") for line in config.getini("markers")):
        config.addinivalue_line("markers", "slow: subprocess servers and other tests that take seconds to start")
