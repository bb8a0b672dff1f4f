"""Suite-wide setup."""

import os

# Before any test module imports torch: see pagedllm/__init__.py (spinning OpenMP threads
# make every op fight for the cores when test, server and engine processes run together).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")



def pytest_collection_modifyitems(config, items):
    """Files with slow tests run first, the rest after, each file's tests in their own order.

    `make test` hands whole files to two workers (`--dist loadfile --no-loadscope-reorder`), in this order,
    each worker taking the next file as it runs low: long files first and the many short ones last let the
    two finish together (longest-first scheduling). pytest-xdist's own order (most tests first) put files
    of one long test, such as the benchmark smoke runs, at the very end, where one worker ran on alone."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)
