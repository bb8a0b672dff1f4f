"""bench/random_gguf.py and random_blocks.py: random K-quant blocks decode to finite weights of the intended
scale, the Q4_K_M and Q3_K_M mixes are llama.cpp's (by its rule, and by its own llama-quantize where that is built), a
Qwen3-MoE file carries the keys llama.cpp's qwen3moe loader reads and loads and generates in pagedllm with its
experts held at the file's size, and a file is written one tensor at a time."""

from __future__ import annotations

import dataclasses
import subprocess
import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pagedllm.bench.random_blocks import BLOCK, WEIGHT_STD, q3_k_m_type, q4_k_m_type, random_blocks, use_more_bits
from pagedllm.bench.random_gguf import SHAPES, Shape, tensor_plan, write_random_gguf


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe-Q4_K_M.gguf", "tiny-qwen3moe",
                             "Q4_K_M")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_random_blocks_decode_finite_at_the_intended_scale(qtype):
    raw = random_blocks(64, 2048, qtype, np.random.default_rng(1))
    assert raw.shape == (64, 2048 // BLOCK[qtype][0] * BLOCK[qtype][1])
    w = dequantize(raw, GGMLQuantizationType[qtype])
    assert w.shape == (64, 2048) and np.isfinite(w).all()
    assert abs(w.std() - WEIGHT_STD) < 0.03 * WEIGHT_STD
    assert abs(w.mean()) < 0.03 * WEIGHT_STD
    if qtype not in ("Q4_0", "Q8_0", "Q5_0"):  # the (super-)block scales (Q4_K, Q5_K: d and dmin; Q5_1: d, m)
        # are normal f16 numbers
        blocks = raw.reshape(-1, BLOCK[qtype][1])
        at = {"Q6_K": slice(208, 210), "Q3_K": slice(108, 110)}.get(qtype, slice(0, 4))
        scales = np.ascontiguousarray(blocks[:, at]).view(np.float16)
        assert (np.abs(scales.astype(np.float32)) >= 2.0**-14).all()


def test_random_blocks_refuse_rows_that_do_not_fill_their_blocks():
    with pytest.raises(ValueError, match="Q4_K row needs a multiple of 256 columns, got 64"):
        random_blocks(4, 64, "Q4_K", np.random.default_rng(0))
    with pytest.raises(ValueError, match="not Q2_K"):
        random_blocks(4, 256, "Q2_K", np.random.default_rng(0))


def test_q4_k_m_is_llama_cpps_rule():
    more = [i for i in range(48) if use_more_bits(i, 48)]
    assert more == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    assert [q4_k_m_type(f"blk.{i}.attn_v.weight", 48, False) for i in (7, 8, 40, 41)] == ["Q4_K", "Q6_K"] * 2
    assert [q4_k_m_type(f"blk.{i}.ffn_down_exps.weight", 48, False) for i in (5, 6)] == ["Q6_K", "Q4_K"]
    assert q4_k_m_type("blk.9.ffn_down.weight", 48, False) == "Q4_K"
    for name in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_gate", "ffn_up"):
        assert q4_k_m_type(f"blk.0.{name}.weight", 48, False) == "Q4_K", name
    assert q4_k_m_type("output.weight", 48, False) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 48, False) == "Q4_K"
    assert q4_k_m_type("token_embd.weight", 16, True) == "Q6_K"  # tied: the embedding is the output too
    for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_q_norm.weight", "output_norm.weight"):
        assert q4_k_m_type(name, 48, False) is None, name


def test_q3_k_m_is_llama_cpps_rule():
    assert [q3_k_m_type(f"blk.{i}.attn_v.weight", 48, False) for i in (0, 1, 2, 47)] == ["Q5_K"] * 2 + ["Q4_K"] * 2
    assert [q3_k_m_type(f"blk.{i}.ffn_down.weight", 48, False) for i in (2, 3)] == ["Q5_K", "Q4_K"]  # 48 / 16 = 3
    assert [q3_k_m_type(f"blk.{i}.ffn_down_exps.weight", 16, False) for i in (0, 1)] == ["Q5_K", "Q4_K"]
    assert q3_k_m_type("blk.5.attn_output.weight", 48, False) == "Q4_K"
    for name in ("attn_q", "attn_k", "ffn_gate_exps", "ffn_up_exps", "ffn_gate", "ffn_up"):
        assert q3_k_m_type(f"blk.0.{name}.weight", 48, False) == "Q3_K", name
    assert q3_k_m_type("output.weight", 48, False) == "Q6_K"
    assert q3_k_m_type("token_embd.weight", 48, False) == "Q3_K"
    assert q3_k_m_type("token_embd.weight", 16, True) == "Q6_K"
    for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_q_norm.weight", "output_norm.weight"):
        assert q3_k_m_type(name, 48, False) is None, name


def test_the_30b_shape_is_qwen3_30b_a3bs_and_17_gib():
    s = SHAPES["qwen3-30b-a3b"]
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.experts, s.experts_used,
            s.expert_intermediate, s.rope_theta, s.arch) == (2048, 48, 32, 4, 128, 128, 8, 768, 1e6, "qwen3moe")
    plan = tensor_plan(s, "Q4_K_M", 49152)
    params = sum(int(np.prod(t.shape)) for t in plan)
    assert 30.0e9 < params < 30.2e9  # 30.5 B with Qwen3's 151936-token vocabulary instead of 49152
    assert 16.5 < sum(t.nbytes for t in plan) / 2**30 < 17.5
    assert sum(t.qtype == "Q6_K" for t in plan if "ffn_down_exps" in t.name) == 24


def test_q4_k_m_refuses_widths_its_types_cannot_hold():
    with pytest.raises(ValueError, match="whose rows need a multiple of 256 columns; the shape gives 64"):
        tensor_plan(SHAPES["tiny"], "Q4_K_M", 49152)
    with pytest.raises(ValueError, match="qtype must be one of"):
        tensor_plan(SHAPES["tiny"], "Q5_K_M", 49152)


@pytest.mark.slow  # gguf's reader over the 49 K tokenizer strings takes ~10 s on a loaded 2-core machine
def test_the_moe_file_has_what_llama_cpps_qwen3moe_loader_reads(tiny_moe):
    reader = GGUFReader(str(tiny_moe))
    s = SHAPES["tiny-qwen3moe"]
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    assert fields["general.architecture"] == "qwen3moe"
    # llama.cpp (src/llama-model.cpp, src/models/qwen3moe.cpp) requires these, and takes the head width from
    # key_length (else hidden / heads: 64 where Qwen3 has 128).
    expected = {"context_length": s.context, "embedding_length": s.hidden, "block_count": s.layers,
                "attention.head_count": s.heads, "attention.head_count_kv": s.kv_heads,
                "attention.key_length": s.head_dim, "attention.value_length": s.head_dim,
                "expert_count": s.experts, "expert_used_count": s.experts_used,
                "expert_feed_forward_length": s.expert_intermediate}
    assert {k: fields[f"qwen3moe.{k}"] for k in expected} == expected
    assert fields["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    tensors = {t.name: t for t in reader.tensors}
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert list(gate.shape) == [s.hidden, s.expert_intermediate, s.experts]  # GGUF order: fastest first
    assert gate.tensor_type == GGMLQuantizationType.Q4_K
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type == GGMLQuantizationType.Q6_K  # the last layer
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == GGMLQuantizationType.F32
    assert tensors["output.weight"].tensor_type == GGMLQuantizationType.Q6_K
    for name in ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"):
        assert list(tensors[name].shape) == [s.head_dim]
    w = dequantize(gate.data, gate.tensor_type)
    assert np.isfinite(w).all() and abs(w.std() - WEIGHT_STD) < 0.05 * WEIGHT_STD


@pytest.mark.slow  # a model load and a generation
def test_pagedllm_serves_the_moe_file_with_experts_at_the_files_size(tiny_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.layers import kquant, quantized
    from pagedllm.model.layers.moe import SparseMoE

    if not quantized.kernel_available():
        pytest.skip("compiled quantized kernel unavailable")
    llm = LLM(model=str(tiny_moe), num_kv_blocks=32, max_model_len=128)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
    moes = [m for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == SHAPES["tiny-qwen3moe"].layers
    file_expert_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(tiny_moe)).tensors if len(t.shape) == 3)
    for moe in moes:
        assert moe.experts.w13.numel() == 0 and moe.experts.w2.numel() == 0  # no float32 copy
        for experts in moe.experts.quant:
            assert experts is not None and len(experts) == SHAPES["tiny-qwen3moe"].experts
            if quantized.int8_kernel_available():  # the default int8 path: the file's super-blocks, not 12 bits
                assert {q.kernel_type for q in experts} <= set(kquant.KERNEL_TYPE.values())
    held = sum(moe.experts.quantized_nbytes for moe in moes)
    assert file_expert_bytes <= held <= 1.05 * file_expert_bytes


def test_a_file_is_written_one_tensor_at_a_time(tmp_path):
    shape = dataclasses.replace(SHAPES["tiny-qwen3moe"], layers=32, experts=16)
    write_random_gguf(tmp_path / "warm.gguf", "tiny-qwen3moe", "Q4_K_M")  # the tokenizer's fields, cached
    plan = tensor_plan(shape, "Q4_K_M", 49152)
    largest = max(t.nbytes for t in plan)
    tracemalloc.start()
    try:
        path = write_random_gguf(tmp_path / "many-layers.gguf", shape, "Q4_K_M")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    assert size > 6 * largest  # a file the layers make, not its largest tensor
    assert peak < 3 * largest, (peak, largest, size)  # the tensor being written (and its random bytes), no more


def _llama_quantize():
    from pagedllm.bench.llamacpp import llama_server_binary

    return llama_server_binary().with_name("llama-quantize")


@pytest.mark.slow
@pytest.mark.skipif(not _llama_quantize().is_file(), reason="llama-quantize not built (scripts/build_llama_server.sh)")
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M"])
def test_mix_types_equal_what_llama_quantize_gives(mix, tmp_path):
    """llama.cpp's own choice, tensor by tensor, over 16 layers (where use_more_bits picks some and not others)."""
    shape = Shape(hidden=256, layers=16, heads=4, kv_heads=2, intermediate=512, dim_per_head=64, experts=4,
                  experts_used=2, expert_intermediate=256, tied_embeddings=False)
    ours = write_random_gguf(tmp_path / "ours.gguf", shape, mix)
    theirs = tmp_path / "theirs.gguf"
    subprocess.run([str(_llama_quantize()), "--allow-requantize", str(ours), str(theirs), mix], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    types = {path: {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors} for path in (ours, theirs)}
    assert types[ours] == types[theirs]
    kinds = list(types[ours].values())
    assert len({v for v in kinds if v.startswith("Q")}) >= (2 if mix == "Q4_K_M" else 4)  # a mix, not one type
    assert sum(v == ("Q6_K" if mix == "Q4_K_M" else "Q5_K") for v in kinds) > 2  # the rule picked some layers
