"""The Triton attention kernels, checked on the CPU under Triton's interpreter.

The cases live in ``triton_interpreter_cases.py`` and run here in a fresh Python with
TRITON_INTERPRET=1 set from the start: triton fixes interpret-or-compile per function when it is
decorated, including its own standard library, and earlier tests of this suite (transformers
models) import triton in compile mode, which the interpreter cannot call into.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the 'triton' package is not installed")
def test_triton_kernels_match_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cases = Path(__file__).with_name("triton_interpreter_cases.py")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(cases)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"interpreter cases failed ({summary}):\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    print(summary)
