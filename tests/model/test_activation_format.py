"""Which activations the linears take at load (model/activation_format.py): int8 by default for a GGUF's
quantized weights, float32 for float checkpoints (also those quantized at load), none the exact mode, a
quiet fallback where the int8 kernel does not run and an error only when int8 was asked for by name."""

import logging

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedllm.model import activation_format, load_model
from pagedllm.model.layers import quantized
from pagedllm.model.model_source import default_gguf_path
from pagedllm.model.layers.linear import LinearBase
from pagedllm.model.layers.moe import SparseMoE
from tests.model.gguf_writer_helpers import write_converted_gguf, write_llama_gguf
from tests.model.tiny_models import make_hf_model, save_hf_model

needs_kernel = pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable")
INT8_TYPES = set(quantized.INT8_KERNEL_TYPE.values())
LOGGER = "pagedllm.model.activation_format"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q4_0.gguf"
    write_llama_gguf(make_hf_model("llama_tied", seed=3), path, GGMLQuantizationType.Q4_0)
    return str(path)


def linear_types(model) -> set[int | None]:
    return {None if m.quant_weight is None else m.quant_weight.kernel_type
            for m in model.modules() if isinstance(m, LinearBase)}


@needs_kernel
def test_a_gguf_takes_int8_by_default_and_none_keeps_float(q4_0_gguf, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model = load_model(q4_0_gguf, quant_activations="auto").model
    assert linear_types(model) == {quantized.INT8_KERNEL_TYPE[quantized.Q4_0]}
    assert model.lm_head.quant_weight.kernel_type == quantized.Q4_0  # the tied head: float activations
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].startswith("linears take int8 activations"), lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        exact = load_model(q4_0_gguf, quant_activations="none").model
    assert linear_types(exact) == {quantized.Q4_0}
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "linears take float32 activations: the exact mode"]
    x = torch.randn(3, exact.model.layers[0].mlp.down_proj.quant_weight.k)
    int8_y = model.model.layers[0].mlp.down_proj.quant_weight.matmul(x)
    exact_y = exact.model.layers[0].mlp.down_proj.quant_weight.matmul(x)
    assert not torch.equal(int8_y, exact_y)  # two kernels, close but not the same sums
    torch.testing.assert_close(int8_y, exact_y, rtol=0.05, atol=0.05 * exact_y.abs().max().item())


def test_auto_keeps_the_embedded_default_model_exact(caplog):
    """The embedded model's first answers would flip with int8 activations (for_model's docstring); a file
    named by the user, and int8 asked for by name, are unchanged."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert activation_format.for_model("auto", None) == "none"
    assert "the embedded default model takes float32 activations" in caplog.text
    assert activation_format.for_model("auto", str(default_gguf_path()), log=False) == "none"  # named by path
    assert activation_format.for_model("auto", "model.gguf") == "auto"
    assert activation_format.for_model("int8", None) == "int8"
    assert activation_format.for_model("none", None) == "none"


@needs_kernel
def test_float_checkpoints_keep_float_activations_unless_int8_is_asked(tmp_path):
    path = save_hf_model(make_hf_model("llama", seed=4), tmp_path / "llama")
    assert linear_types(load_model(path, quant_activations="auto").model) == {None}
    at_load = load_model(path, quantization="int8", quant_activations="auto").model  # weight-only Q8_0
    assert linear_types(at_load) == {quantized.Q8_0}
    asked = load_model(path, quantization="int8", quant_activations="int8").model
    assert linear_types(asked) == {quantized.INT8_KERNEL_TYPE[quantized.Q8_0]}


def test_without_the_int8_kernel_auto_falls_back_and_int8_is_refused(q4_0_gguf, monkeypatch, caplog):
    if not quantized.kernel_available():
        pytest.skip("compiled quantized kernel unavailable")
    monkeypatch.setattr(quantized, "int8_kernel_available", lambda: False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model = load_model(q4_0_gguf, quant_activations="auto").model
    assert linear_types(model) == {quantized.Q4_0}
    assert "the int8-activation kernel does not run here" in caplog.text
    with pytest.raises(ValueError, match="--quant-activations int8: the int8-activation kernel does not run here"):
        load_model(q4_0_gguf, quant_activations="int8")


@needs_kernel
def test_mixture_of_experts_experts_take_int8(tmp_path):
    path = tmp_path / "tiny-mixtral-Q8_0.gguf"
    write_converted_gguf(make_hf_model("mixtral", seed=4, sliding_window=None), path, GGMLQuantizationType.Q8_0)
    int8 = load_model(str(path), quant_activations="auto").model
    moes = [m for m in int8.modules() if isinstance(m, SparseMoE)]
    assert moes and all(q.kernel_type == quantized.INT8_KERNEL_TYPE[quantized.Q8_0]
                        for m in moes for experts in m.experts.quant for q in experts)
    exact = load_model(str(path), quant_activations="none").model
    x = torch.randn(5, moes[0].gate.weight.shape[1])
    moe_exact = [m for m in exact.modules() if isinstance(m, SparseMoE)][0]
    with torch.no_grad():
        y8, y32 = moes[0](x), moe_exact(x)
    torch.testing.assert_close(y8, y32, rtol=0.05, atol=0.05 * y32.abs().max().item())


@needs_kernel
def test_an_int8_lm_head_gets_its_own_copy_and_the_lookup_keeps_its_rows(q4_0_gguf):
    """The measured option (bench accuracy): the tied head on the int8 kernel, the embedding untouched."""
    from pagedllm.model.activation_format import use_int8_lm_head

    model = load_model(q4_0_gguf, quant_activations="auto").model
    embedding = model.model.embed_tokens.quant_weight
    before = model.lm_head.quant_weight
    x = torch.randn(4, before.k)
    float_logits = before.matmul(x)
    assert use_int8_lm_head(model)
    head = model.lm_head.quant_weight
    assert head is not before and head.kernel_type == quantized.INT8_KERNEL_TYPE[quantized.Q4_0]
    assert embedding.kernel_type == quantized.Q4_0 and embedding.rows(torch.tensor([0, 5])).shape == (2, before.k)
    torch.testing.assert_close(head.matmul(x), float_logits, rtol=0.05, atol=0.05 * float_logits.abs().max().item())
