"""For each GGUF architecture llama.cpp defines beyond llama/qwen3 (gemma2, gemma3, phi3, qwen3moe,
and Mixtral as ``llama`` with experts), a tiny random HF model written as llama.cpp's converter
writes it loads through the engine and generates greedily token for token as HF does on the same
(dequantized) weights, logprobs within 1e-3 (near-tie rule: tests/hf_reference.py). The MoE
twins also in Q4_0, with their quantized stacked experts held quantized: the file's bytes.

Each twin is shaped as llama.cpp can read it: Gemma's query scale is head_dim ** -0.5 and Gemma 3
has 5 local layers to 1 global (neither is stored in GGUF; llama.cpp fixes them), Qwen3-MoE has
no dense layer, and Mixtral no sliding window (the ``llama`` GGUF keys carry none)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from transformers import AutoModelForCausalLM

from pagedllm import LLM
from pagedllm.errors import ModelLoadError
from pagedllm.model import gguf_arch, load_model
from pagedllm.model.gguf_loader import hf_tensor_name
from pagedllm.model.loader import resolve_hf_dir
from pagedllm.model.layers import quantized
from pagedllm.model.layers.moe import SparseMoE
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.gguf_writer_helpers import spm_vocab, write_converted_gguf
from tests.model.tiny_models import make_hf_model

TWINS = {
    "gemma2": ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=32)),
    "gemma3": ("Gemma3ForCausalLM", dict(query_pre_attn_scalar=32, num_hidden_layers=6,
                                         layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    "phi3": ("Phi3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[])),
    "mixtral": ("MixtralForCausalLM", dict(sliding_window=None)),
}
# Hyperparameters the GGUF must carry (or llama.cpp fix) for the twin to be the same model.
CHECKED_FIELDS = ("num_hidden_layers", "num_key_value_heads", "sliding_window", "layer_types", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters", "num_experts",
                  "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "mlp_only_layers", "tie_word_embeddings")


def _f32(value):
    """``value`` with its floats as GGUF stores them (float32): phi3's rope factors 1 + 0.1 * i."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: _f32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_f32(v) for v in value]
    return value


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


MOE_KINDS = ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("kind, qtype", [(k, q) for k in TWINS for q in ("F16", "Q8_0")]
                         + [(k, "Q4_0") for k in MOE_KINDS])
def test_gguf_twin_matches_hf(kind, qtype, tmp_path):
    architecture, overrides = TWINS[kind]
    hf_model = make_hf_model(kind, seed=7, **overrides)
    hf_model.generation_config.eos_token_id = None
    path = tmp_path / f"tiny-{kind}-{qtype}.gguf"
    hf_model.load_state_dict(write_converted_gguf(hf_model, path, GGMLQuantizationType[qtype]))

    loaded = load_model(str(path))
    assert type(loaded.model).__name__ == architecture
    for field in CHECKED_FIELDS:
        if hasattr(hf_model.config, field):
            assert _f32(getattr(loaded.hf_config, field)) == _f32(getattr(hf_model.config, field)), field

    llm = LLM(model=str(path), max_num_batched_tokens=37, quant_activations="none")  # the exact mode
    if kind in MOE_KINDS and qtype != "F16" and quantized.kernel_available():
        _assert_experts_held_quantized(llm.engine.core.executor.runner.model, path, qtype)
        dequantized = load_model(str(path), gguf_dequantize=True).model  # --gguf-dequantize: float experts
        assert all(m.experts.quant == [None, None] for m in dequantized.modules() if isinstance(m, SparseMoE))
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40, 77)]  # 77 > 4 windows of 16
    for prompt, (ids, logprobs) in zip(prompts, engine_greedy(llm, prompts, 10)):
        ref = hf_greedy(hf_model, prompt, 10)
        assert assert_matches_reference(ids, logprobs, ref, f"{kind} {qtype} gguf") == "exact"
    if qtype == "Q8_0":  # the converted directory (with weights) is a checkpoint transformers reads as the twin
        assert str(resolve_hf_dir(str(path))) == loaded.model_path
        again = AutoModelForCausalLM.from_pretrained(loaded.model_path, dtype=torch.float32).eval()
        ids = torch.tensor([list(range(3, 40))])
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, hf_model(ids).logits, atol=1e-5, rtol=0)


def _assert_experts_held_quantized(model, path, qtype: str) -> None:
    """The stacked experts the file holds quantized are QuantizedWeights of the file's bytes (the
    float parameters empty); those it holds as floats (Qwen3-MoE's down: 48 columns are not whole
    32-wide blocks, so the writer fell back to F16, as llama.cpp's converter does) stay float."""
    reader = GGUFReader(path)
    file_types = {t.name: t.tensor_type.name for t in reader.tensors if "_exps" in t.name}
    quantized_bytes = sum(int(t.n_bytes) for t in reader.tensors if "_exps" in t.name and t.tensor_type.name == qtype)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moes and quantized_bytes > 0
    for layer, moe in zip((m for m, mod in enumerate(model.model.layers) if isinstance(mod.mlp, SparseMoE)), moes):
        for which, (param, tensors) in enumerate(((moe.experts.w13, ("ffn_gate_exps", "ffn_up_exps")),
                                                  (moe.experts.w2, ("ffn_down_exps",)))):
            in_file = {file_types[f"blk.{layer}.{t}.weight"] for t in tensors}
            if in_file == {qtype}:
                assert [q.qtype for q in moe.experts.quant[which]] == [GGMLQuantizationType[qtype]] * param.shape[0]
                assert param.numel() == 0  # no float32 copy
            else:
                assert moe.experts.quant[which] is None and param.numel() > 0
    assert sum(moe.experts.quantized_nbytes for moe in moes) == quantized_bytes  # the file's bytes, no more


def test_tensor_names_follow_the_architecture():
    # One GGUF spelling, two meanings: Llama's norm before the MLP, Gemma's pre-feedforward norm.
    llama_cfg, gemma_cfg = make_hf_model("llama").config, make_hf_model("gemma2").config
    assert hf_tensor_name("blk.2.ffn_norm.weight", llama_cfg) == "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight", gemma_cfg) == "model.layers.2.pre_feedforward_layernorm.weight"
    assert (hf_tensor_name("blk.2.post_attention_norm.weight", gemma_cfg)
            == "model.layers.2.post_attention_layernorm.weight")
    with pytest.raises(ModelLoadError, match=r"attn_qkv.*gemma2"):  # a tensor llama.cpp's gemma2 never reads
        hf_tensor_name("blk.0.attn_qkv.weight", gemma_cfg)
    with pytest.raises(ModelLoadError, match=r"per-expert"):  # old Mixtral files: one tensor per expert
        hf_tensor_name("blk.0.ffn_gate.3.weight", llama_cfg)


_REQUIRED = object()


def _meta(values: dict):
    """A metadata reader as gguf_to_hf_config hands hf_config one, over ``values``."""
    def meta(key, default=_REQUIRED):
        if key in values:
            return values[key]
        if default is _REQUIRED:
            raise ModelLoadError(f"missing {key}")
        return default
    return meta


def test_phi3_partial_rotary_and_half_longrope_are_refused():
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match="partial rotary"):
        gguf_arch.hf_config("phi3", _meta({"rope.dimension_count": 12}), common, {}, {})
    with pytest.raises(ModelLoadError, match="rope_factors_long / rope_factors_short"):
        gguf_arch.hf_config("phi3", _meta({}), common, {}, {gguf_arch.ROPE_FACTOR_TENSORS[0]: [1.0] * 8})
    config = gguf_arch.hf_config("phi3", _meta({}), common, {}, {})  # no factors: plain rope
    assert config.rope_parameters["rope_type"] == "default" and config.sliding_window is None


def test_gemma_hyperparameters_llama_cpp_fixes():
    common = dict(hidden_size=4608, num_attention_heads=32, num_key_value_heads=16, head_dim=128, num_hidden_layers=46,
                  intermediate_size=256, vocab_size=512, max_position_embeddings=8192, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)
    big = gguf_arch.hf_config("gemma2", _meta({"attention.sliding_window": 4096}), common, {}, {})
    assert big.query_pre_attn_scalar == 144  # Gemma 2 27B: hidden / heads, not head_dim
    assert big.layer_types[:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    small = gguf_arch.hf_config("gemma2", _meta({"attention.sliding_window": 4096}),
                                dict(common, num_hidden_layers=4), {}, {})
    assert small.query_pre_attn_scalar == 128
    stored = gguf_arch.hf_config("gemma3", _meta({"attention.sliding_window": 512,
                                                  "attention.sliding_window_pattern": [True, False, False, True]}),
                                 dict(common, num_hidden_layers=4), {}, {})
    assert stored.layer_types == ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    assert stored.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    unwindowed = gguf_arch.hf_config("gemma3", _meta({}), dict(common, num_hidden_layers=4), {}, {})
    assert unwindowed.layer_types == ["full_attention"] * 4


@pytest.mark.parametrize("kind", ["gemma2", "phi3"])
def test_sentencepiece_tokenizer_comes_from_the_file(kind, tmp_path):
    """Gemma and Phi-3 GGUFs carry a sentencepiece vocabulary (no merges): the converted directory's
    tokenizer is rebuilt from it (transformers' GGUF tokenizer builders)."""
    # Each word with every prefix, so the merges rebuilt from the vocabulary can reach it.
    pieces = [w[:n] for w in ("\u2581hello", "\u2581world") for n in range(1, len(w) + 1)]
    vocab = spm_vocab(512, list(dict.fromkeys(pieces + list("helowrd"))))
    hf_model = make_hf_model(kind, seed=7, **TWINS[kind][1])
    path = tmp_path / f"tiny-{kind}-vocab.gguf"
    write_converted_gguf(hf_model, path, vocab=vocab)
    loaded = load_model(str(path))
    tokenizer = loaded.tokenizer
    assert (loaded.hf_config.bos_token_id, loaded.hf_config.eos_token_id) == (2, 1)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert vocab.index("\u2581world") in ids and all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids) == "hello world"
