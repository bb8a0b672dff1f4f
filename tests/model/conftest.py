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
