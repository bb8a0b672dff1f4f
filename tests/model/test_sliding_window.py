"""Sliding-window attention and score soft-capping: the torch reference against a dense
definition, and the compiled CPU op against the reference on every path (decode, prompt chunks
over a cached prefix, mixed steps; per-key and tiled items; context splits; 16-bit caches)."""

import pytest
import torch

from pagedllm.model.attention import cpu_op
from pagedllm.model.attention.paged import paged_attention
from tests.model.conftest import require_compiled_cpu_ops
from tests.model.test_cpu_attention import PATHS, available_isas, random_case


def dense_reference(query, kv_cache, metadata, scale, window, softcap=None):
    """Each token's softmax over the keys of its window, from the gathered contiguous K/V."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    for s, seq_len in enumerate(metadata.seq_lens.tolist()):
        blocks = metadata.block_tables[s, : -(-seq_len // block_size)]
        k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]  # [L, Hkv, D]
        v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q_len = starts[s + 1] - starts[s]
        for r in range(q_len):
            pos = seq_len - q_len + r
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,lhd->hl", query[starts[s] + r], k[lo : pos + 1]) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[starts[s] + r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo : pos + 1])
    return out


CASES = [  # (seq_lens, query_lens): decode only, one long prompt, chunks over a prefix, mixed
    ([37, 5, 80, 16], [1, 1, 1, 1]),
    ([70], [70]),
    ([90, 40], [25, 40]),
    ([100, 3, 64, 33], [1, 3, 20, 1]),
]


# (window, softcap); a cap of 0.5 on scores of about +-3 (random_case's scale) bends every one
OPTIONS = [(1, None), (5, None), (16, None), (33, None), (1000, None), (None, 0.5), (16, 0.5), (None, 50.0)]


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("seq_lens,query_lens", CASES)
def test_reference_masks_keys_outside_the_window(seq_lens, query_lens, window, softcap):
    query, kv_cache, metadata, scale = random_case(seq_lens, query_lens, head_dim=32, block_size=8)
    expected = dense_reference(query, kv_cache, metadata, scale, window, softcap)
    out = paged_attention(query, kv_cache, metadata, scale, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if softcap == 0.5:  # the cap changes the result (else this would not test it)
        assert not torch.allclose(out, dense_reference(query, kv_cache, metadata, scale, window), atol=1e-3)


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("seq_lens,query_lens", CASES)
def test_compiled_op_matches_reference(seq_lens, query_lens, window, softcap):
    require_compiled_cpu_ops()
    query, kv_cache, metadata, scale = random_case(seq_lens, query_lens, head_dim=64, block_size=16)
    expected = paged_attention(query, kv_cache, metadata, scale, sliding_window=window, softcap=softcap)
    for isa in available_isas():
        for path, num_splits in [("default", 0), ("tiled", 0), ("per_key", 0), ("per_key", 3), ("tiled", 2)]:
            for kv in (kv_cache, kv_cache.to(torch.bfloat16)):
                ref = expected if kv.dtype == torch.float32 else paged_attention(
                    query, kv, metadata, scale, sliding_window=window, softcap=softcap)
                out = cpu_op.paged_attention_cpu(query, kv, metadata, scale, num_splits=num_splits, isa=isa,
                                                 tile_min_rows=PATHS[path], sliding_window=window, softcap=softcap)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"isa {isa}, {path}, splits {num_splits}, {kv.dtype}: {m}")


def test_compiled_op_without_window_is_unchanged():
    require_compiled_cpu_ops()
    query, kv_cache, metadata, scale = random_case([90, 40], [25, 40])
    torch.testing.assert_close(cpu_op.paged_attention_cpu(query, kv_cache, metadata, scale),
                               paged_attention(query, kv_cache, metadata, scale), atol=1e-5, rtol=1e-5)


def test_a_backend_without_windows_or_softcap_refuses_such_models():
    """set_attention_backend names the missing feature (the triton kernels have neither) and changes
    no layer."""
    from pagedllm.model.attention.backend import TORCH_BACKEND, AttentionBackend
    from pagedllm.model.attention.layer import set_attention_backend
    from pagedllm.model.gemma import Gemma2ForCausalLM
    from tests.model.tiny_models import tiny_config

    class NoWindow(AttentionBackend):
        name = "no-window"
        supports_sliding_window = False

    class NoSoftcap(AttentionBackend):
        name = "no-softcap"
        supports_softcap = False

    model = Gemma2ForCausalLM(tiny_config("gemma2"))
    with pytest.raises(ValueError, match="no-window.*sliding-window"):
        set_attention_backend(model, NoWindow())
    with pytest.raises(ValueError, match="no-softcap.*soft-capping"):
        set_attention_backend(model, NoSoftcap())
    layers = [layer.self_attn.attn for layer in model.model.layers]
    assert all(layer.backend is TORCH_BACKEND for layer in layers)
    assert [layer.sliding_window for layer in layers] == [16, None, 16, None]  # Gemma 2 alternates
