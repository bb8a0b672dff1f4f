"""Shared fixtures for model tests: the embedded default model, converted once per test run."""

import os

import pytest

from pagedllm.model import gguf_loader, load_model


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """``(loaded, cache_dir, num_conversions)`` for load_model(None) into a fresh cache for the test run."""
    cache = tmp_path_factory.mktemp("pagedllm-cache")
    calls = []
    real_convert = gguf_loader.convert_gguf_to_hf_dir

    def counting_convert(*args, **kwargs):
        calls.append(args)
        return real_convert(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE", str(cache))
        mp.setattr(gguf_loader, "convert_gguf_to_hf_dir", counting_convert)
        loaded = load_model(None)
    return loaded, cache, len(calls)


def _missing_build_tools() -> str | None:
    """What this machine lacks to compile csrc/ (a C++ compiler, Python headers), or None."""
    import shutil
    import sysconfig
    from pathlib import Path

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return "no Python headers (Python.h)"
    return None


def require_compiled_cpu_ops() -> None:
    """Build and load the compiled CPU library (csrc/) if needed. Skips only where it truly cannot
    run (no compiler or headers, a CPU without AVX2); a compile error on a machine that has the
    tools fails the test, so a broken csrc/ never turns into green skips."""
    from pagedllm.model.attention import cpu_op

    if cpu_op.load():
        return
    missing = _missing_build_tools()
    if missing is not None:
        pytest.skip(f"CPU op library cannot be built here: {missing}")
    try:
        cpu_op.build()
    except Exception as exc:
        pytest.fail(f"building the CPU op library (csrc/) failed on a machine with the tools: {exc}")
    cpu_op._state.clear()
    if not cpu_op.load():
        reason = cpu_op.unavailable_reason() or ""
        if "lacks AVX2" in reason or "_CPU_OP is set" in reason:
            pytest.skip(f"CPU op library unavailable: {reason}")
        pytest.fail(f"the CPU op library was built but does not load: {reason}")


@pytest.fixture
def int8_kernels_only():
    """The int8-activation kernels for every row count: a CPU with AMX-BF16 sends calls of many rows through
    the bf16 prefill path instead (csrc/quant_gemm_op.cpp; tests/model/test_bf16_prefill.py tests that)."""
    import torch

    from pagedllm.model.layers import quantized

    if not (quantized.kernel_available() and hasattr(torch.ops.pagedllm, "quant_gemm_bf16_rows")):
        yield
        return
    previous = int(torch.ops.pagedllm.quant_gemm_bf16_rows(0))
    yield
    torch.ops.pagedllm.quant_gemm_bf16_rows(previous)
