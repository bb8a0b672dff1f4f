"""Suite-wide setup."""

import os

# Before any test module imports torch: see pagedllm/__init__.py (spinning OpenMP threads
# make every op fight for the cores when test, server and engine processes run together).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

