"""A long step's MLP in row slices (llama.MLP_WORKSPACE_BYTES): the same rows as one call, fewer bytes at once."""

import pytest
import torch

from pagedllm import LLM
from pagedllm.lora.layers import LoRAStep, lora_step
from pagedllm.model import llama, load_model
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.tiny_models import make_hf_model, save_hf_model

TEN_ROWS = 10 * 2 * 128 * 4
"""A workspace of 10 rows of the tiny Llama's gate/up (2 x 128 float32)."""


@pytest.fixture(scope="module")
def hf_and_path(tmp_path_factory):
    hf = make_hf_model("llama")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mlp(hf_and_path):
    return load_model(hf_and_path[1]).model.model.layers[0].mlp


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
    monkeypatch.setattr(llama, "MLP_WORKSPACE_BYTES", TEN_ROWS)
    sliced, sliced_calls = _calls(mlp, x.clone())
    assert sliced_calls == [10, 10, 10, 7]
    # Equal up to float32 summation order: the GEMM's register blocks (and with them how a row's k-steps are
    # split over accumulators) follow the call's row count, and they differ between ISAs (bit-equal with
    # AVX-512 here, not with AVX2).
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


def test_a_sliced_step_writes_its_output_over_its_input(mlp, monkeypatch):
    """No second [T, hidden] buffer: each slice's rows of x are read, then overwritten by their output. A
    non-contiguous x is left alone (its rows are not one block to write back into)."""
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    expected, _ = _calls(mlp, x.clone())
    monkeypatch.setattr(llama, "MLP_WORKSPACE_BYTES", TEN_ROWS)
    out, calls = _calls(mlp, x)
    assert calls == [10, 10, 10, 7] and out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

    strided = torch.randn(64, 37, generator=torch.Generator().manual_seed(3)).t()  # [37, 64], not contiguous
    before = strided.clone()
    out, _ = _calls(mlp, strided)
    assert out.data_ptr() != strided.data_ptr() and torch.equal(strided, before)
    torch.testing.assert_close(out, _calls(mlp, before.contiguous())[0], rtol=1e-5, atol=1e-5)


def test_sliced_prefill_generates_as_hf(hf_and_path, monkeypatch):
    """Prompts of 40-70 tokens, prefilled together in one step with 10-row MLP slices: every layer's MLP
    overwrites its input, and the generations are HF's."""
    monkeypatch.setattr(llama, "MLP_WORKSPACE_BYTES", TEN_ROWS)
    hf, path = hf_and_path
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((40, 70, 53))]
    llm = LLM(model=path)
    for prompt, (ids, logprobs) in zip(prompts, engine_greedy(llm, prompts, 8)):
        assert_matches_reference(ids, logprobs, hf_greedy(hf, prompt, 8), f"{len(prompt)}-token prompt")


def test_a_lora_step_is_not_sliced(mlp, monkeypatch):
    """LoRA's segments index the step's rows: a slice would read the wrong ones."""
    monkeypatch.setattr(llama, "MLP_WORKSPACE_BYTES", TEN_ROWS)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with lora_step(LoRAStep([0, 37, 0])):
        _, calls = _calls(mlp, x)
    assert calls == [37]
