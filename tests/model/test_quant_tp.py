"""Quantized GGUF weights under tensor parallelism: two ranks, each reading its shard of the GGUF
still quantized (rows for column-parallel layers, whole 32-column blocks for row-parallel ones),
give the single-rank quantized engine's greedy tokens and logprobs, with float32 activations and with
int8 ones (the default: a row-parallel shard quantizes its own 32-wide blocks of x, the blocks one rank
quantizes; only the float sum over K is cut in two, as with float32 activations)."""

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedllm import LLM
from pagedllm.model.layers import quantized
from tests.hf_reference import engine_greedy
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.tiny_models import make_hf_model

pytestmark = pytest.mark.skipif(not quantized.kernel_available(), reason="compiled quantized kernel unavailable")


@pytest.fixture(autouse=True)
def one_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_two_ranks_equal_one_on_a_q4_0_gguf(tmp_path, activations):
    if activations == "int8" and not quantized.int8_kernel_available():
        pytest.skip("int8-activation kernel unavailable")
    path = tmp_path / "tiny-Q4_0.gguf"
    write_llama_gguf(make_hf_model("llama", seed=8), path, GGMLQuantizationType.Q4_0)
    prompts = [list(range(3, 20)), [7, 8, 9], list(range(100, 140))]
    single = LLM(model=str(path), num_kv_blocks=64, quant_activations=activations)
    model = single.engine.core.executor.runner.model
    kernel_type = {"none": quantized.Q4_0, "int8": quantized.INT8_KERNEL_TYPE[quantized.Q4_0]}[activations]
    assert model.model.layers[0].mlp.down_proj.quant_weight.kernel_type == kernel_type
    expected = engine_greedy(single, prompts, 8)
    del single
    sharded = LLM(model=str(path), tensor_parallel_size=2, num_kv_blocks=64, distributed_timeout=60,
                  quant_activations=activations)
    assert sharded.engine.core.executor.gguf_path == str(path.resolve())  # the ranks read the GGUF
    results = engine_greedy(sharded, prompts, 8)
    assert [ids for ids, _ in results] == [ids for ids, _ in expected]
    for (_, logprobs), (_, ref) in zip(results, expected):
        assert logprobs == pytest.approx(ref, abs=1e-4)
