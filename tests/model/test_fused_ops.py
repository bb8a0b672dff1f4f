"""The compiled small CPU ops (csrc/fused_ops.cpp) against the layers' torch reference definitions.

Every op must equal the reference bit for bit (the norm sums squares in ATen's order and SiLU uses
torch's vectorized exp, for the vector width torch uses on this CPU; a subprocess checks the AVX2
width). With the ops switched off, the layers take the torch path. The library is built here if
this checkout's is missing (as in test_cpu_attention.py).
"""

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import rotate_half

from pagedllm.model.attention import cpu_op
from pagedllm.model.layers import cpu_fused
from pagedllm.model.layers.activation import SiluAndMul
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding
from tests.model.conftest import require_compiled_cpu_ops



@pytest.fixture(scope="module", autouse=True)
def compiled_ops():
    require_compiled_cpu_ops()
    cpu_fused.reset()
    assert cpu_fused.ops() is not None
    assert cpu_fused.ops().norm_lanes is not None, "the compiled norm rounds unlike torch's here"
    assert cpu_fused.ops().silu_block is not None, "the compiled SiLU rounds unlike torch's here"
    yield
    cpu_fused.reset()


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) + 1.0)
    return norm


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("rows", [1, 7, 14, 64, 301])
@pytest.mark.parametrize("hidden", [576, 64, 100, 8, 13, 2048, 4096, 5000])
def test_rms_norm_equals_reference_bit_for_bit(rows, hidden, monkeypatch):
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = _norm(hidden, rows)
    x = torch.randn(rows, hidden, generator=gen) * 4
    residual = torch.randn(rows, hidden, generator=gen)
    native = _counting(monkeypatch, RMSNorm, "forward_native")
    with torch.inference_mode():
        assert torch.equal(norm(x), norm.forward_native(x))
        ref_normed, ref_summed = norm.forward_native(x, residual)
        normed, summed = norm(x, residual)  # dense rows: written into x and residual
    assert len(native) == 2  # the two reference calls above only: the module took the op
    assert torch.equal(summed, ref_summed) and torch.equal(normed, ref_normed)
    assert normed.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    assert not torch.equal(normed, summed)


def test_rms_norm_strided_rows_and_inputs_kept():
    norm = _norm(96, 0)
    base = torch.randn(5, 200)
    x, residual = base[:, 3:99], torch.randn(5, 96)  # row stride 200
    x_before, residual_before = x.clone(), residual.clone()
    with torch.inference_mode():
        normed, summed = norm(x, residual)
        ref_normed, ref_summed = norm.forward_native(x, residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # not in place
    assert torch.equal(summed, ref_summed) and torch.equal(normed, ref_normed)


_OTHER_WIDTH = """
import torch
from pagedllm.model.layers import cpu_fused
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.activation import SiluAndMul
assert torch.backends.cpu.get_cpu_capability() == "AVX2"
assert cpu_fused.ops() is not None and cpu_fused.ops().rms_norm is not None
gen = torch.Generator().manual_seed(0)
for hidden in (576, 100, 13, 4096):
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data.copy_(torch.randn(hidden, generator=gen) + 1.0)
    x, r = torch.randn(37, hidden, generator=gen) * 4, torch.randn(37, hidden, generator=gen)
    with torch.inference_mode():
        assert torch.equal(norm(x), norm.forward_native(x)), hidden
        reference = norm.forward_native(x, r)[0]
        assert torch.equal(norm(x, r)[0], reference), hidden  # (in place: x and r change)
act = SiluAndMul()
assert cpu_fused.ops().silu_and_mul is not None
for d in (1536, 48, 40, 13):
    x = torch.randn(5, 2 * d, generator=gen) * 6
    with torch.inference_mode():
        assert torch.equal(act(x), act.forward_native(x)), d
print("ok")
"""


def test_norm_and_silu_bit_for_bit_with_avx2_aten_kernels():
    """As on an AVX2-only CPU: torch's kernels forced to AVX2 with ATEN_CPU_CAPABILITY."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip("needs an x86 CPU with AVX2")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _OTHER_WIDTH], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.parametrize("head_dim", [64, 128, 32, 80])
@pytest.mark.parametrize("rows,heads,kv_heads", [(1, 9, 3), (14, 9, 3), (33, 8, 8), (5, 32, 4)])
def test_rotate_qkv_equals_reference_bit_for_bit(head_dim, rows, heads, kv_heads):
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096)
    rot = RotaryEmbedding(config, head_dim)
    gen = torch.Generator().manual_seed(rows + head_dim)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    cos_sin = rot.cos_sin(positions, qkv.dtype)
    # HF's formula over our tables, queries and keys separately.
    cos, sin = rot.cos_cache[positions][:, None], rot.sin_cache[positions][:, None]
    heads_view = qkv.view(rows, -1, head_dim)
    q_ref, k_ref, v_ref = heads_view.split([heads, kv_heads, kv_heads], dim=1)
    q_ref = q_ref * cos + rotate_half(q_ref) * sin
    k_ref = k_ref * cos + rotate_half(k_ref) * sin
    v_ref = v_ref.clone()
    with torch.inference_mode():
        q, k, v = rot.rotate_qkv(qkv, cos_sin, heads, kv_heads)
    assert q.shape == (rows, heads, head_dim) and k.shape == v.shape == (rows, kv_heads, head_dim)
    assert q.data_ptr() == qkv.data_ptr()  # in place, views of the projection
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_rotate_qkv_rejects_mismatched_tables():
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=64)
    rot = RotaryEmbedding(config, 64)
    cos, ssin = rot.cos_sin(torch.tensor([1, 2]), torch.float32)
    with pytest.raises(RuntimeError, match="cos and signed_sin"):
        torch.ops.pagedllm.rotary_qk_cpu(torch.randn(3, 6 * 64), cos, ssin, 4, 64)


@pytest.mark.parametrize("rows", [1, 3, 14, 65])
@pytest.mark.parametrize("d", [1536, 64, 13, 48, 8192, 100])
def test_silu_and_mul_equals_reference_bit_for_bit(rows, d, monkeypatch):
    gen = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, 2 * d, generator=gen) * 6
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated exp and zero
    act = SiluAndMul()
    native = _counting(monkeypatch, SiluAndMul, "forward_native")
    with torch.inference_mode():
        out = act(x)
        ref = act.forward_native(x)
    assert len(native) == 1
    assert torch.equal(out, ref)
    if d >= 3:
        assert out[0, 1] == 100.0 * x[0, d + 1] and out[0, 2] == 0.0


def test_switched_off_layers_take_torch_path(monkeypatch):
    monkeypatch.setenv(cpu_fused.DISABLE_ENV, "1")
    cpu_fused.reset()
    try:
        assert cpu_fused.ops() is None
        norm, act = _norm(64, 1), SiluAndMul()
        x, residual = torch.randn(4, 64), torch.randn(4, 64)
        with torch.inference_mode():
            normed, summed = norm(x, residual)
            ref_normed, ref_summed = norm.forward_native(x, residual)
            assert torch.equal(normed, ref_normed) and torch.equal(summed, ref_summed)
            assert torch.equal(act(x), act.forward_native(x))
            config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=64)
            rot = RotaryEmbedding(config, 64)
            qkv = torch.randn(4, 4 * 64)
            before = qkv.clone()
            q, k, v = rot.rotate_qkv(qkv, rot.cos_sin(torch.tensor([0, 3, 9, 63]), qkv.dtype), 2, 1)
            assert torch.equal(qkv, before)  # the torch path does not rotate in place
            heads = before.view(4, 4, 64)
            expected = rot.rotate(heads[:, :3], rot.cos_sin(torch.tensor([0, 3, 9, 63]), qkv.dtype))
            assert torch.equal(torch.cat([q, k], dim=1), expected) and torch.equal(v, heads[:, 3:])
    finally:
        monkeypatch.delenv(cpu_fused.DISABLE_ENV)
        cpu_fused.reset()


def test_other_dtypes_take_torch_path():
    norm = _norm(64, 2).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert cpu_fused.usable(x) is None
    with torch.inference_mode():
        assert torch.equal(norm(x), norm.forward_native(x))
        assert torch.equal(SiluAndMul()(x), SiluAndMul().forward_native(x))


def test_norm_that_rounds_differently_is_not_used(monkeypatch):
    """A compiled norm off by one ulp anywhere fails calibration: the norms then keep the torch path."""
    real = torch.ops.pagedllm.rms_norm_cpu.default

    def off_by_an_ulp(x, weight, eps, lanes):
        out = real(x, weight, eps, lanes)
        out[-1, -1] = torch.nextafter(out[-1, -1], torch.tensor(float("inf")))
        return out

    assert cpu_fused.calibrate_norm_lanes(real) in (8, 16)
    assert cpu_fused.calibrate_norm_lanes(off_by_an_ulp) is None
    monkeypatch.setattr(cpu_fused, "calibrate_norm_lanes", lambda rms_norm: None)
    cpu_fused.reset()
    try:
        norm = _norm(64, 3)
        native = _counting(monkeypatch, RMSNorm, "forward_native")
        with torch.inference_mode():
            norm(torch.randn(3, 64))
        assert len(native) == 1 and cpu_fused.ops().rotary_qk is not None
    finally:
        cpu_fused.reset()
