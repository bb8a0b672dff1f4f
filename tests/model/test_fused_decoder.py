"""The fused decoder call (model/layers/fused_decoder.py, csrc/decoder_layer.cpp) against the per-op
path on the same model: logits equal bit for bit (the same ops in the same order) over prefills,
decode batches of 1..N and mixed steps, for float32 and GGUF-quantized weights, both GEMM ISAs;
close to Hugging Face; and the models and steps it does not cover take the per-op path."""

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedllm.model import load_model
from pagedllm.model.attention.backend import CpuAttentionBackend
from pagedllm.model.attention.layer import set_attention_backend
from pagedllm.model.layers import fused_decoder
from tests.model.conftest import require_compiled_cpu_ops
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.paged_kv_helpers import PagedRunner
from tests.model.tiny_models import make_hf_model, save_hf_model


@pytest.fixture(autouse=True)
def compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    require_compiled_cpu_ops()
    yield
    fused_decoder.set_enabled(None)


HEADS_32 = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
"""The tiny models' 4 heads of 16 are no head_dim the compiled attention has (those take the
reference attention, and the per-op path): 2 query heads and 1 KV head of 32 instead."""


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# Steps of (seq_id, new tokens): prefills of different lengths together, decodes of 1, 2 and 3
# sequences, a mixed step (a new prompt chunk beside decodes), then decodes again.
STEPS = [
    [(0, prompt(0, 13))],
    [(1, prompt(1, 5)), (2, prompt(2, 9))],
    [(0, [7])],
    [(0, [8]), (1, [9])],
    [(0, [10]), (1, [11]), (2, [12])],
    [(3, prompt(3, 6)), (0, [13]), (2, [14])],
    [(0, [15]), (1, [16]), (2, [17]), (3, [18])],
    [(3, [19])],
]


class Counter:
    """Counts the steps that took the fused call."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = fused_decoder.FusedDecoder.__call__

        def counted(decoder, *args):
            self.calls += 1
            return real(decoder, *args)

        monkeypatch.setattr(fused_decoder.FusedDecoder, "__call__", counted)


def run_steps(model, enabled: bool) -> list[torch.Tensor]:
    fused_decoder.set_enabled(enabled)
    runner = PagedRunner(model, block_size=4)
    return [runner.step(step) for step in STEPS]


def with_cpu_backend(model):
    set_attention_backend(model, CpuAttentionBackend())
    return model


def assert_fused_equals_per_op(model, monkeypatch) -> list[torch.Tensor]:
    counter = Counter(monkeypatch)
    per_op = run_steps(model, False)
    assert counter.calls == 0
    fused = run_steps(model, True)
    assert counter.calls == len(STEPS)  # every step took the fused call
    for a, b in zip(fused, per_op):
        assert torch.equal(a, b)
    return fused


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "llama_tied_scaled", "qwen2", "mistral"])
def test_float32_fused_equals_per_op_and_hf(kind, tmp_path, monkeypatch):
    hf = make_hf_model(kind, seed=3, **({} if kind == "llama_tied_scaled" else HEADS_32))
    model = with_cpu_backend(load_model(save_hf_model(hf, tmp_path / kind)).model)
    fused = assert_fused_equals_per_op(model, monkeypatch)
    # Sequence 0 alone against HF: its prompt (step 0), then its decode rows.
    ids = STEPS[0][0][1] + [7, 8, 10, 13, 15]
    rows = [fused[0]] + [fused[i][0:1] for i in (2, 3, 4)] + [fused[5][6:7], fused[6][0:1]]
    torch.testing.assert_close(torch.cat(rows), hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_float32_both_gemm_isas(isa, tmp_path, monkeypatch):
    from pagedllm.model.layers import cpu_gemm

    if cpu_gemm.panel_width(isa) == 0:
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", isa)
    model = with_cpu_backend(load_model(save_hf_model(make_hf_model("llama", seed=4, **HEADS_32), tmp_path / "m")).model)
    assert model.model.layers[0].self_attn.qkv_proj.gemm_weight.shape[-1] == cpu_gemm.panel_width(isa)
    assert_fused_equals_per_op(model, monkeypatch)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("isa", ["best", "avx2"])
def test_quantized_fused_equals_per_op(qtype, isa, tmp_path, monkeypatch):
    from pagedllm.model.layers import quantized

    if not quantized.kernel_available():
        pytest.skip("compiled quantized kernel unavailable")
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", isa)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_llama_gguf(make_hf_model("llama_tied", seed=5), path, GGMLQuantizationType[qtype])
    model = with_cpu_backend(load_model(str(path)).model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_weight is not None
    if isa == "avx2":
        assert qkv.quant_weight.isa == 1
    head_calls = []
    real_head = type(model.lm_head).compute_logits
    monkeypatch.setattr(type(model.lm_head), "compute_logits", lambda head, x: head_calls.append(1) or real_head(head, x))
    assert_fused_equals_per_op(model, monkeypatch)  # the logits too: the head's kernel called directly (head_logits)
    assert len(head_calls) == len(STEPS)  # the per-op steps only: the fused ones left the head's module out


@pytest.mark.parametrize("int8", [False, True])
def test_mixed_type_weights_take_the_fused_call_group_by_group(int8, tmp_path, monkeypatch):
    """A Q4_K_M-like file (q/k and gate/up in Q4_K, v and down in Q6_K): the fused q/k/v is held as row groups
    (layers/quant_groups.py), and the fused call runs each group's kernel into one output, bit for bit the
    per-op path's, in the exact float mode and with int8 activations."""
    import numpy as np

    from pagedllm.model.layers import quantized
    from pagedllm.model.layers.quant_groups import QuantizedRowGroups
    from tests.model.test_quant_kernels import random_k_quant

    if not quantized.kernel_available():
        pytest.skip("compiled quantized kernel unavailable")
    if int8 and not quantized.int8_kernel_available():
        pytest.skip("the int8-activation kernel is unavailable")
    hf = make_hf_model("llama_tied", seed=6, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64)
    rng = np.random.default_rng(6)
    override = {}
    for i in range(hf.config.num_hidden_layers):
        for name, qtype, rows, cols in (("attn_q", quantized.Q4_K, 256, 256), ("attn_k", quantized.Q4_K, 128, 256),
                                        ("attn_v", quantized.Q6_K, 128, 256), ("attn_output", quantized.Q4_K, 256, 256),
                                        ("ffn_gate", quantized.Q4_K, 512, 256), ("ffn_up", quantized.Q4_K, 512, 256),
                                        ("ffn_down", quantized.Q6_K, 256, 512)):
            override[f"blk.{i}.{name}.weight"] = (random_k_quant(qtype, rows, cols, rng, scale=(1e-3, 3e-3)),
                                                  GGMLQuantizationType(qtype))
    path = tmp_path / "mixed.gguf"
    write_llama_gguf(hf, path, GGMLQuantizationType.Q8_0, override=override)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    args = {"quant_activations": "int8" if int8 else "none"}
    model = with_cpu_backend(load_model(str(path), **args).model)
    qkv = model.model.layers[0].self_attn.qkv_proj.quant_weight
    assert isinstance(qkv, QuantizedRowGroups) and [g.n for g in qkv.groups] == [384, 128]
    assert assert_fused_equals_per_op(model, monkeypatch)[0].isfinite().all()


def test_not_covered_models_take_the_per_op_path(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    for kind in ("qwen3", "mistral_window", "gemma2"):
        model = load_model(save_hf_model(make_hf_model(kind, **HEADS_32), tmp_path / kind)).model
        with_cpu_backend(model)
        run_steps(model, True)
        assert model.model.__dict__["_fused_decoder"][-1] is None, kind
    assert counter.calls == 0


def test_torch_backend_hooks_and_long_steps_take_the_per_op_path(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    model = load_model(save_hf_model(make_hf_model("llama", seed=6, **HEADS_32), tmp_path / "m")).model
    run_steps(model, True)  # the torch reference backend: not covered
    assert counter.calls == 0
    with_cpu_backend(model)  # decided again for the compiled backend
    run_steps(model, True)
    assert counter.calls == len(STEPS)
    # A hook on a layer's module (bench profile's timers) must see its calls: per-op path.
    seen = []
    handle = model.model.layers[0].self_attn.qkv_proj.register_forward_hook(lambda *a: seen.append(1))
    run_steps(model, True)
    handle.remove()
    assert counter.calls == len(STEPS) and len(seen) == len(STEPS)
    # Over MAX_TOKENS tokens in one step: per-op path, same logits as per-op path.
    monkeypatch.setattr(fused_decoder, "MAX_TOKENS", 8)
    runner = PagedRunner(model, block_size=4)
    long_fused = runner.step([(0, prompt(9, 12))])
    assert counter.calls == len(STEPS)
    fused_decoder.set_enabled(False)
    assert torch.equal(long_fused, PagedRunner(model, block_size=4).step([(0, prompt(9, 12))]))


def test_switch_off_by_environment(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    model = with_cpu_backend(load_model(save_hf_model(make_hf_model("llama", seed=7, **HEADS_32), tmp_path / "m")).model)
    fused_decoder.set_enabled(None)
    monkeypatch.setenv("PAGEDLLM_DISABLE_FUSED_DECODER", "1")
    PagedRunner(model, block_size=4).step(STEPS[0])
    assert counter.calls == 0
    monkeypatch.setenv("PAGEDLLM_DISABLE_FUSED_DECODER", "0")
    PagedRunner(model, block_size=4).step(STEPS[0])
    assert counter.calls == 0  # read once, at the first step: a step reads no environment
    fused_decoder.set_enabled(None)  # the environment again
    PagedRunner(model, block_size=4).step(STEPS[0])
    assert counter.calls == 1


def test_a_kv_cache_it_does_not_write_takes_the_per_op_path(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    model = with_cpu_backend(load_model(save_hf_model(make_hf_model("llama", seed=8, **HEADS_32), tmp_path / "m")).model)
    fused_decoder.set_enabled(True)
    runner = PagedRunner(model, block_size=4)
    runner.kv_caches = [cache.to(torch.float64) for cache in runner.kv_caches]  # not a type the op stores
    runner.step(STEPS[0])
    assert counter.calls == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_kv_caches(dtype, tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    model = with_cpu_backend(load_model(save_hf_model(make_hf_model("qwen2", seed=9, **HEADS_32), tmp_path / "m")).model)
    results = []
    for enabled in (False, True):
        fused_decoder.set_enabled(enabled)
        runner = PagedRunner(model, block_size=4)
        runner.kv_caches = [cache.to(dtype) for cache in runner.kv_caches]
        results.append([runner.step(step) for step in STEPS])
    assert counter.calls == len(STEPS)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_lora_steps_take_the_fused_call_with_the_per_op_sums(tmp_path, monkeypatch):
    """LoRA slots on every linear (ranks 8, 3 and 5; one adapter without the MLP): steps that mix adapted and
    base rows take the fused call, and equal the per-op path bit for bit (both call lora_sgmv_cpu on the same
    arguments); the adapters change the logits of their rows only."""
    from pagedllm.lora.layers import lora_step
    from pagedllm.lora.manager import LoRAManager

    model = with_cpu_backend(load_model(save_hf_model(make_hf_model("llama", seed=6, **HEADS_32), tmp_path / "m")).model)
    base = run_steps(model, True)
    manager = LoRAManager(model, max_loras=3, max_lora_rank=8, max_cpu_loras=3)
    g = torch.Generator().manual_seed(8)
    for (layer, name), slots in manager.slots.items():
        for slot, rank in enumerate((8, 3, 5)):
            if slot == 2 and name.startswith("mlp"):
                continue
            slots.set_slot(slot, rank, [(torch.randn(rank, slots.in_features, generator=g) * 0.1,
                                         torch.randn(size, rank, generator=g) * 0.1) for size in slots.part_sizes])
    slot_of = {0: None, 1: 0, 2: 1, 3: 2}  # sequence 0 stays on the base model

    def run(enabled: bool) -> list[torch.Tensor]:
        fused_decoder.set_enabled(enabled)
        runner = PagedRunner(model, block_size=4)
        out = []
        for step in STEPS:
            rows = manager.rows_of([slot_of[seq] for seq, _ in step], [len(tokens) for _, tokens in step])
            with lora_step(rows):
                out.append(runner.step(step))
        return out

    counter = Counter(monkeypatch)
    per_op = run(False)
    assert counter.calls == 0
    fused = run(True)
    assert counter.calls == len(STEPS)
    for a, b in zip(fused, per_op):
        assert torch.equal(a, b)
    assert torch.equal(fused[0], base[0]) and torch.equal(fused[2], base[2])  # sequence 0 alone: no adapter
    assert not torch.equal(fused[1][:5], base[1][:5]) and not torch.equal(fused[1][5:], base[1][5:])


def test_phase_clock_divides_the_call(tmp_path, monkeypatch):
    """decoder_layers_clock_cpu: off, it counts nothing; on, each call's linears, attention and other ops
    add up to no more than the call's wall time, and reading resets it."""
    import time

    clock = torch.ops.pagedllm.decoder_layers_clock_cpu
    model = with_cpu_backend(load_model(save_hf_model(make_hf_model("llama", seed=4, **HEADS_32), tmp_path / "m")).model)
    clock(False)
    run_steps(model, True)
    assert clock(False) == [0.0, 0.0, 0.0, 0.0]

    fused_decoder.set_enabled(True)
    runner = PagedRunner(model, block_size=4)
    clock(True)
    start = time.perf_counter()
    for step in STEPS:
        runner.step(step)
    wall = time.perf_counter() - start
    linear, attention, other, calls = clock(False)
    assert calls == len(STEPS)
    assert linear > 0 and attention > 0 and other > 0
    assert linear + attention + other <= wall
    assert clock(False) == [0.0, 0.0, 0.0, 0.0]  # read and reset, and left off


def test_the_plan_and_the_call_check_their_arguments(tmp_path):
    """DecoderPlan refuses lists of the wrong length and norm weights the plain kernels cannot read; the call
    refuses a position past the rotary tables (it gathers their rows itself) before touching a cache."""
    model = with_cpu_backend(load_model(save_hf_model(make_hf_model("llama", seed=4, **HEADS_32), tmp_path / "m")).model)
    fused_decoder.set_enabled(True)
    PagedRunner(model, block_size=4).step(STEPS[0])
    decoder = model.model.__dict__["_fused_decoder"][-1]
    assert decoder is not None
    attn = model.model.layers[0].self_attn
    ints = [attn.num_local_heads, attn.num_local_kv_heads, attn.head_dim, 16, 32, 0, 0, 0]
    floats = [0.125, 1e-5, 1e-5]
    norm = model.model.norm.weight
    empty = [torch.empty(0)] * 8  # two linears: up to 3 row groups and a bias each
    weights = [w for layer in model.model.layers
               for w in (layer.input_layernorm.weight, *empty, layer.post_attention_layernorm.weight, *empty)]
    one_group = [1] + [0] * 9  # the number of row groups, then (kind, n, isa) for each of 3
    info = one_group * (4 * len(model.model.layers))
    torch.classes.pagedllm.DecoderPlan(weights, info, [], [], norm, ints, floats)  # well-formed
    with pytest.raises(RuntimeError, match="row groups per linear"):
        torch.classes.pagedllm.DecoderPlan(weights, [4] + info[1:], [], [], norm, ints, floats)
    with pytest.raises(RuntimeError, match="weights per layer"):
        torch.classes.pagedllm.DecoderPlan(weights[:-1], info, [], [], norm, ints, floats)
    with pytest.raises(RuntimeError, match="ints per layer"):
        torch.classes.pagedllm.DecoderPlan(weights, info[:-1], [], [], norm, ints, floats)
    with pytest.raises(RuntimeError, match="norm weights"):
        torch.classes.pagedllm.DecoderPlan(weights, info, [], [], norm.double(), ints, floats)

    rotary = model.model.rotaries[model.model.rotary_keys[0]]
    hidden = torch.zeros(1, norm.numel())
    caches = [torch.zeros(1) for _ in model.model.layers]  # never reached
    index = torch.zeros(1, dtype=torch.int64)
    for position in (rotary.cos_cache.shape[0], -1):
        with pytest.raises(RuntimeError, match="rotary tables"):
            decoder._op(hidden, rotary.cos_cache, rotary.signed_sin_cache, torch.tensor([position]), decoder.plan,
                        caches, index, index, index, index, ())
