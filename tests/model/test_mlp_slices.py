"""A long step's MLP in row slices (llama.MLP_WORKSPACE_BYTES): the same rows as one call, fewer bytes at once."""

import pytest
import torch

from pagedllm.lora.layers import LoRAStep, lora_step
from pagedllm.model import llama, load_model
from tests.model.tiny_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    path = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))
    return load_model(path).model.model.layers[0].mlp


def _calls(mlp, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """mlp(x) and the rows of each gate/up call it made."""
    rows: list[int] = []
    handle = mlp.gate_up_proj.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        with torch.inference_mode():
            return mlp(x), rows
    finally:
        handle.remove()


def test_a_step_over_the_workspace_runs_in_slices_with_the_same_rows(mlp, monkeypatch):
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    whole, whole_calls = _calls(mlp, x)
    assert whole_calls == [37]  # the default workspace holds thousands of this model's rows
    # 10 rows of gate/up (2 x 128 float32) at once: slices of 10, 10, 10, 7
    monkeypatch.setattr(llama, "MLP_WORKSPACE_BYTES", 10 * 2 * 128 * 4)
    sliced, sliced_calls = _calls(mlp, x)
    assert sliced_calls == [10, 10, 10, 7]
    # Equal up to float32 summation order: the GEMM's register blocks (and with them how a row's k-steps are
    # split over accumulators) follow the call's row count, and they differ between ISAs (bit-equal with
    # AVX-512 here, not with AVX2).
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


def test_a_lora_step_is_not_sliced(mlp, monkeypatch):
    """LoRA's segments index the step's rows: a slice would read the wrong ones."""
    monkeypatch.setattr(llama, "MLP_WORKSPACE_BYTES", 10 * 2 * 128 * 4)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with lora_step(LoRAStep([0, 37, 0])):
        _, calls = _calls(mlp, x)
    assert calls == [37]
