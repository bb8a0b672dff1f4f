"""A long step's MLP runs in slices of rows (``llama.MLP_ROW_CHUNK``), which bounds its largest buffers;
the result is Hugging Face's MLP on the same weights, and LoRA steps keep the whole batch in one call."""

import torch

from pagedllm.lora.layers import LoRAStep, lora_step
from pagedllm.model import llama, load_model
from tests.model.tiny_models import make_hf_model, save_hf_model


def _count_calls(module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_long_step_mlp_in_slices_equals_hf(tmp_path, monkeypatch):
    monkeypatch.setattr(llama, "MLP_ROW_CHUNK", 16)  # the tiny model's rows, not 512
    hf = make_hf_model("llama", seed=3)
    ours = load_model(save_hf_model(hf, tmp_path / "m")).model
    mlp, hf_mlp = ours.model.layers[1].mlp, hf.model.layers[1].mlp
    calls = _count_calls(mlp.gate_up_proj)
    x = torch.randn(16 * 2 + 5, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))

    out = mlp(x)

    assert calls[0] == 3  # 16 + 16 + 5 rows
    with torch.no_grad():
        torch.testing.assert_close(out, hf_mlp(x), atol=1e-5, rtol=1e-5)
    short = x[:32]  # up to two slices' rows: one call
    mlp(short)
    assert calls[0] == 4


def test_lora_step_keeps_the_batch_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(llama, "MLP_ROW_CHUNK", 16)
    hf = make_hf_model("llama", seed=3)
    ours = load_model(save_hf_model(hf, tmp_path / "m")).model
    mlp = ours.model.layers[0].mlp
    calls = _count_calls(mlp.gate_up_proj)
    x = torch.randn(40, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))

    with lora_step(LoRAStep(segments=[0, 40, 0])):  # segments index the step's rows
        out = mlp(x)

    assert calls[0] == 1
    with torch.no_grad():
        torch.testing.assert_close(out, hf.model.layers[0].mlp(x), atol=1e-5, rtol=1e-5)
