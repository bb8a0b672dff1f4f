"""The batch-invariant mode with int8 activations (the default for a GGUF's quantized weights): a
request's tokens and logprobs are bitwise equal alone and in batches of 4 and 16 random neighbours, with
its prompt chunked, at 1 and 2 threads, on tiny Q4_0 and Q8_0 GGUFs whose linears run the int8
kernel (the default model, Q4_1, runs the same comparisons in test_batch_invariance.py), and, for the
exact mode's quantized invariant call, the Q4_0 one with ``quant_activations="none"``.

The int8 kernel has no separate invariant call: each row is quantized on its own and summed in a fixed
order (model/batch_invariant.py). ``test_a_batch_dependent_activation_scale_is_caught`` plants the
bug that would break it, one scale shared by the batch's rows, and the comparisons see it."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedllm import LLM
from pagedllm.model.attention import cpu_op
from pagedllm.model.layers import quantized
from pagedllm.model.layers.linear import LinearBase
from tests.engine.test_batch_invariance import _logprobs
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.tiny_models import make_hf_model

pytestmark = pytest.mark.skipif(not (cpu_op.load() and quantized.int8_kernel_available()),
                                reason="the mode needs the compiled CPU ops, this test the int8 kernel")

@pytest.fixture(scope="module")
def write_gguf(tmp_path_factory):
    """qtype -> a tiny Llama (head_dim 32, vocabulary 4096: the shared prompts' token ids) as a GGUF of that
    type, written once per module."""
    written: dict[str, str] = {}

    def write(qtype: str) -> str:
        if qtype not in written:
            path = tmp_path_factory.mktemp("int8_bi") / f"tiny-{qtype}.gguf"
            hf_model = make_hf_model("llama_tied", seed=11, vocab_size=4096, max_position_embeddings=512)
            write_llama_gguf(hf_model, path, GGMLQuantizationType[qtype])
            written[qtype] = str(path)
        return written[qtype]

    return write


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def _llm(model: str, **kwargs) -> LLM:
    llm = LLM(model=model, batch_invariant=True, enable_prefix_caching=False, **{"block_size": 16, **kwargs})
    kinds = {m.quant_weight.kernel_type for m in llm.engine.core.executor.runner.model.modules()
             if isinstance(m, LinearBase)}
    int8 = set(quantized.INT8_KERNEL_TYPE.values())
    if kwargs.get("quant_activations", "auto") == "none":  # the float32-activation kernels' invariant call
        assert kinds and not kinds & int8, kinds
    else:
        assert kinds and kinds <= int8, kinds  # the default: int8 activations
    return llm


@pytest.mark.parametrize("qtype, activations", [("Q4_0", "auto"), ("Q8_0", "auto"), ("Q4_0", "none")])
def test_batches_and_chunks(write_gguf, qtype, activations):
    gguf = write_gguf(qtype)
    reference = _logprobs(_llm(gguf, num_threads=1, quant_activations=activations))
    # the target's prompt in 2-3 chunks, with others
    llm = _llm(gguf, num_threads=2, max_num_batched_tokens=37, quant_activations=activations)
    for size in (1, 4, 16):
        assert _logprobs(llm, neighbours=size - 1, seed=size) == reference, f"batch of {size}"
    short = _llm(gguf, num_threads=1, max_num_batched_tokens=5, quant_activations=activations)
    assert _logprobs(short, neighbours=2, seed=5) == reference, "chunks of 5"


def test_a_batch_dependent_activation_scale_is_caught(write_gguf, monkeypatch):
    """int8 activations quantized with one scale for the whole batch (its largest |x| per 32-block) instead
    of each row's own: a row's result then moves with its neighbours, and the comparisons fail. (The
    fused decoder step is turned off so every linear goes through the planted call.)"""
    from pagedllm.model import batch_invariant
    from pagedllm.model.layers import fused_decoder

    real = batch_invariant.quant_gemm

    def shared_scale(x, weight, bias):
        m, k = x.shape
        blocks = x.view(m, k // 32, 32)
        scale = blocks.abs().amax(dim=(0, 2), keepdim=True).clamp_min(1e-30) / 127  # over the batch's rows
        return real(((blocks / scale).round() * scale).view(m, k), weight, bias)

    gguf = write_gguf("Q4_0")
    monkeypatch.setattr(batch_invariant, "quant_gemm", shared_scale)
    fused_decoder.set_enabled(False)
    try:
        reference = _logprobs(_llm(gguf, num_threads=1))
        llm = _llm(gguf, num_threads=1)
        assert any(_logprobs(llm, neighbours=size - 1, seed=size) != reference for size in (4, 16))
    finally:
        fused_decoder.set_enabled(None)
