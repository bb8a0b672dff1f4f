"""The decode step's host-side shortcuts: each must give what the long way gives.

* ``AttentionBackend.attend`` (one check, then both ops) against ``write_kv_cache`` + ``forward``,
  and its fall-back to the reference for inputs the compiled ops do not take;
* ``DirectChildren``'s plain-attribute copies of child modules never going stale;
* ``RotaryEmbedding.cos_sin`` against the cos/sin caches it is built from.
"""

import copy

import pytest
import torch
from torch import nn

from pagedllm.model.attention.backend import TORCH_BACKEND, CpuAttentionBackend
from pagedllm.model.attention.paged import paged_attention, write_kv_cache
from pagedllm.model.layers.direct_children import DirectChildren
from tests.model.conftest import require_compiled_cpu_ops
from tests.model.paged_kv_helpers import build_metadata


def decode_case(kv_dtype=torch.float32, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tables, seq_lens, query_lens = [[3, 7, 1], [5, 0], [2]], [40, 17, 1], [1, 4, 1]
    metadata = build_metadata(tables, seq_lens, query_lens, 16)
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (4 + 2 * 2) * head_dim, generator=gen)  # views of one row, as in the model
    q, k, v = qkv.view(num_tokens, -1, head_dim).split_with_sizes([4, 2, 2], dim=1)
    kv_cache = (torch.randn(2, 8, 16, 2, head_dim, generator=gen)).to(kv_dtype)
    return q, k, v, kv_cache, metadata, head_dim**-0.5


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_cpu_attend_equals_write_then_forward(kv_dtype):
    require_compiled_cpu_ops()
    q, k, v, kv_cache, metadata, scale = decode_case(kv_dtype)
    backend = CpuAttentionBackend()
    long_cache = kv_cache.clone()
    backend.write_kv_cache(k, v, long_cache, metadata.slot_mapping)
    expected = backend.forward(q, long_cache, metadata, scale)
    out = backend.attend(q, k, v, kv_cache, metadata, scale)
    assert torch.equal(kv_cache, long_cache)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", ["float64", "head_dim_48", "strided_cache"])
def test_cpu_attend_falls_back_to_the_reference(case):
    require_compiled_cpu_ops()
    q, k, v, kv_cache, metadata, scale = decode_case(head_dim=48 if case == "head_dim_48" else 64)
    if case == "float64":
        q, k, v, kv_cache = q.double(), k.double(), v.double(), kv_cache.double()
    if case == "strided_cache":  # a non-contiguous cache: the compiled KV write does not take it
        kv_cache = torch.cat([kv_cache, kv_cache], dim=-2)[..., ::2, :]
        assert not kv_cache.is_contiguous()
    ref_cache = kv_cache.clone()
    write_kv_cache(k, v, ref_cache, metadata.slot_mapping)
    expected = paged_attention(q, ref_cache, metadata, scale)
    out = CpuAttentionBackend().attend(q, k, v, kv_cache, metadata, scale)
    assert torch.equal(kv_cache, ref_cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_base_attend_is_write_then_forward():
    q, k, v, kv_cache, metadata, scale = decode_case()
    ref_cache = kv_cache.clone()
    write_kv_cache(k, v, ref_cache, metadata.slot_mapping)
    expected = paged_attention(q, ref_cache, metadata, scale)
    out = TORCH_BACKEND.attend(q, k, v, kv_cache, metadata, scale)
    assert torch.equal(kv_cache, ref_cache) and torch.equal(out, expected)


class Parent(DirectChildren):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(2, 2)
        self.weight = nn.Parameter(torch.ones(2))


def test_direct_children_follow_every_change():
    m = Parent()
    assert m.__dict__["child"] is m._modules["child"]  # read without nn.Module.__getattr__
    replacement = nn.ReLU()
    m.child = replacement
    assert m.child is replacement and m._modules["child"] is replacement
    m.child = None
    assert m.child is None and m._modules["child"] is None
    m.child = nn.Tanh()
    del m.child
    assert not hasattr(m, "child")
    m.add_module("extra", nn.ReLU())
    assert m.extra is m._modules["extra"]
    m.extra = nn.Parameter(torch.zeros(1))  # a child replaced by a parameter: the copy goes
    assert isinstance(m.extra, nn.Parameter) and "extra" not in m._modules
    m.register_module("late", nn.Identity())
    clone = copy.deepcopy(m)
    assert clone.late is clone._modules["late"] and clone.late is not m.late
    assert set(m.state_dict()) == {"weight", "extra"}
    assert [name for name, _ in m.named_children()] == ["late"]


def test_direct_children_keep_hooks():
    m = Parent()
    calls = []
    m.child.register_forward_hook(lambda mod, args, out: calls.append(mod))
    m.child(torch.zeros(1, 2))
    assert calls == [m._modules["child"]]


def test_cos_sin_matches_the_caches():
    from transformers import LlamaConfig

    from pagedllm.model.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=128), 32)
    positions = torch.tensor([0, 5, 127, 5])
    cos, signed_sin = rot.cos_sin(positions, torch.float32)
    sin = rot.sin_cache[positions][:, None]
    assert torch.equal(cos, rot.cos_cache[positions][:, None])
    assert torch.equal(signed_sin, torch.cat((-sin[..., :16], sin[..., 16:]), dim=-1))
    assert cos.shape == (4, 1, 32) and cos.is_contiguous() and signed_sin.is_contiguous()
    with pytest.raises(IndexError):
        rot.cos_sin(torch.tensor([128]), torch.float32)
