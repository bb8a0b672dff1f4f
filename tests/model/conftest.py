"""Shared fixtures for model tests: the embedded default model, converted once per session."""

import pytest

from pagedllm.model import gguf_loader, load_model


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """``(loaded, cache_dir, num_conversions)`` for load_model(None) into a fresh session cache."""
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


def require_compiled_cpu_ops() -> None:
    """Build and load the compiled CPU library (csrc/) if needed, or skip where it truly cannot be."""
    from pagedllm.model.attention import cpu_op

    if cpu_op.load():
        return
    try:
        cpu_op.build()
    except Exception as exc:  # no compiler / headers: genuinely unavailable here
        pytest.skip(f"CPU op library cannot be built here: {exc}")
    cpu_op._state.clear()
    if not cpu_op.load():
        pytest.skip(f"CPU op library unavailable: {cpu_op.unavailable_reason()}")
