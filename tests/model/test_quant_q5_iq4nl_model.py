"""A tiny Llama written as a Q5_0 GGUF, as a mix of Q5_0 and Q5_1 with a tied embedding (the fused q/k/v a row
group of Q5_0 beside one of Q5_1, as llama-quantize's fallbacks leave a Q4_K_M file of 896-wide rows), and as an
IQ4_NL GGUF: in the exact mode (``--quant-activations none``) its greedy tokens equal Hugging Face transformers' on
the dequantized weights; with int8 activations every weight, the embedding and the LM head included, is held in
the int8 kernel's file-size layout (the file's bytes exactly), the rows looked up are gguf's bit for bit, the
one-call decoder steps as the per-op path, and the engine generates what the model steps."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagedllm import LLM, SamplingParams
from pagedllm.bench.random_blocks import random_blocks
from pagedllm.model import load_model
from pagedllm.model.layers import fused_decoder, iq4nl, quantized
from pagedllm.model.layers.quant_weight import AT_FILE_SIZE
from tests.model.gguf_writer_helpers import _inverse, gguf_name, write_llama_gguf
from tests.model.test_fused_decoder import assert_fused_equals_per_op, with_cpu_backend
from tests.model.test_quant_model import IDS, greedy, linears
from tests.model.test_quant_q3k_model import WEIGHT_SCALE, held_weights, parts
from tests.model.tiny_models import make_hf_model

needs_kernel = pytest.mark.skipif(not quantized.int8_kernel_available(), reason="int8-activation kernel unavailable")


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


def mixed_type(name: str) -> str:
    """Q5_1 for v, the MLP's gate and up and the (tied) embedding; Q5_0 for the rest."""
    return "Q5_1" if any(part in name for part in ("attn_v", "ffn_gate", "ffn_up", "token_embd")) else "Q5_0"


def scaled_blocks(rows: int, cols: int, type_name: str, rng) -> np.ndarray:
    if type_name == "IQ4_NL":  # random indices; d for weights of standard deviation 0.02 x WEIGHT_SCALE
        blocks = rng.integers(0, 256, (rows * cols // 32, 18), dtype=np.uint8)
        rms = float(np.sqrt(np.mean(iq4nl.KVALUES.astype(np.float64) ** 2)))
        blocks[:, :2] = np.full((blocks.shape[0], 1), 0.02 * WEIGHT_SCALE / rms, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    raw = random_blocks(rows, cols, type_name, rng)
    blocks = raw.reshape(-1, quantized.GGUF_BLOCKS[int(GGMLQuantizationType[type_name])][1])
    for offset in (0, 2) if type_name == "Q5_1" else (0,):  # d (and m): the weights scale with them
        scaled = blocks[:, offset : offset + 2].copy().view(np.float16) * np.float16(WEIGHT_SCALE)
        blocks[:, offset : offset + 2] = scaled.view(np.uint8)
    return raw


def write_q5_file(tmp_path, mix: str):
    """``(path, hf twin on the dequantized weights, {GGUF name: (raw, type)})`` for ``mix`` Q5_0, Q5_mixed or
    IQ4_NL."""
    hf = make_hf_model("llama", seed=7, hidden_size=256, intermediate_size=512, head_dim=64,
                       tie_word_embeddings=mix == "Q5_mixed")
    cfg = hf.config
    rng = np.random.default_rng(1)
    override, twin = {}, {}
    for name, tensor in hf.state_dict().items():
        if tensor.dim() != 2 or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        target = gguf_name(name)
        type_name = mixed_type(target) if mix == "Q5_mixed" else mix
        qtype = GGMLQuantizationType[type_name]
        raw = scaled_blocks(tensor.shape[0], tensor.shape[1], type_name, rng)
        override[target] = (raw, qtype)
        held = dequantize(raw, qtype).reshape(tensor.shape)  # the file's rows: q and k in llama.cpp's order
        if name.endswith("q_proj.weight"):
            held = _inverse(held, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            held = _inverse(held, cfg.num_key_value_heads)
        twin[name] = torch.from_numpy(np.ascontiguousarray(held, dtype=np.float32))
    path = tmp_path / f"tiny-{mix}.gguf"
    write_llama_gguf(hf, path, GGMLQuantizationType.F32, override=override)
    hf.load_state_dict(twin, strict=False)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return path, hf, override


@needs_kernel
@pytest.mark.parametrize("mix", ["Q5_0", "Q5_mixed", "IQ4_NL"])
def test_q5_and_iq4_nl_files_equal_transformers_exactly_and_run_int8_at_the_files_size(mix, tmp_path, monkeypatch):
    path, hf, override = write_q5_file(tmp_path, mix)
    types = {qtype.name for _, qtype in override.values()}
    assert types == ({"Q5_0", "Q5_1"} if mix == "Q5_mixed" else {mix})

    exact = load_model(str(path), quant_activations="none").model
    assert {p.kernel_type for w in held_weights(exact) for p in parts(w)} == {quantized.QX}
    tokens_exact, logits_exact = greedy(exact, IDS, 8)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([IDS]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(IDS) :].tolist()
        hf_logits = hf(torch.tensor([IDS])).logits[0]
    assert tokens_exact == expected
    torch.testing.assert_close(logits_exact, hf_logits, atol=1e-4 * float(hf_logits.abs().max()), rtol=0)

    model = load_model(str(path), quant_activations="int8").model
    weights = held_weights(model)
    held_types = set()
    for weight in weights:
        for part in parts(weight):
            assert part.kernel_type == AT_FILE_SIZE[part.qtype].KERNEL_TYPE[part.qtype], (part.qtype, part.kernel_type)
            held_types.add(GGMLQuantizationType(part.qtype).name)
    assert held_types == types
    if mix == "Q5_mixed":  # q and k in Q5_0, v in Q5_1: one linear of two row groups; the head is the embedding
        qkv = model.model.layers[0].self_attn.qkv_proj.quant_weight
        assert [GGMLQuantizationType(g.qtype).name for g in qkv.groups] == ["Q5_0", "Q5_1"]
        assert model.lm_head.quant_weight is model.model.embed_tokens.quant_weight
    file_bytes = sum(raw.size for raw, _ in override.values())
    held = sum(w.nbytes for w in weights)
    assert file_bytes <= held <= 1.05 * file_bytes, (held, file_bytes)
    embed_raw, embed_type = override["token_embd.weight"]
    ids = torch.tensor([0, 5, 31, 5, 511])
    rows = dequantize(embed_raw, embed_type).reshape(-1, 256)[ids.numpy()]
    assert torch.equal(model.model.embed_tokens(ids), torch.from_numpy(rows))  # bit for bit gguf's

    tokens_q, logits_q = greedy(model, IDS, 8)
    # int8 activations round each 32-block to 1/254 of its largest value; a wrong byte or scale is off by all of it
    assert 0 < float((logits_q - logits_exact).abs().mean()) < 0.1 * float(logits_exact.abs().mean())
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    for int8_layer, exact_layer in zip(linears(model) + [model.lm_head], linears(exact) + [exact.lm_head]):
        rows = x.repeat(1, exact_layer.quant_weight.k // 256)
        q, d, _ = quantized.quantize_activations(rows)
        want = exact_layer.quant_weight.matmul((q.float().view(5, -1, 32) * d.unsqueeze(-1)).reshape(rows.shape))
        got = int8_layer.quant_weight.matmul(rows)
        torch.testing.assert_close(got, want, atol=2e-6 * float(want.abs().max()) * rows.shape[1] ** 0.5, rtol=0)

    try:  # the one-call decoder (its row groups, its embedding lookup) steps as the per-op path, bit for bit
        assert_fused_equals_per_op(with_cpu_backend(model), monkeypatch)
    finally:
        fused_decoder.set_enabled(None)

    llm = LLM(model=str(path), quant_activations="int8", num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == tokens_q
