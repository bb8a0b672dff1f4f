"""The compiled CPU paged-attention op against the torch reference (``paged.paged_attention``).

The op is built by ``make setup``; a session fixture builds it if this checkout's library is
missing, so these tests run (never skip) wherever a C++ compiler exists.
"""

import math

import pytest
import torch

from pagedllm.model.attention import cpu_op
from pagedllm.model.attention.backend import CpuAttentionBackend, make_attention_backend, resolve_backend_name
from pagedllm.model.attention.paged import paged_attention, write_kv_cache
from tests.model.paged_kv_helpers import build_metadata
from tests.model.conftest import require_compiled_cpu_ops


@pytest.fixture(scope="module", autouse=True)
def compiled_op():
    require_compiled_cpu_ops()




def available_isas() -> list[int]:
    best = int(torch.ops.pagedllm.cpu_isa())
    return list(range(1, best + 1))


def random_case(seq_lens, query_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                shared_prefix_blocks=0, seed=0):
    """A cache full of random values, shuffled block tables (the first ``shared_prefix_blocks``
    blocks of every sequence are the same physical blocks), queries for the last positions."""
    gen = torch.Generator().manual_seed(seed)
    own = [math.ceil(s / block_size) - shared_prefix_blocks for s in seq_lens]
    assert min(own) >= 0
    num_blocks = sum(own) + shared_prefix_blocks + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [perm.pop() for _ in range(shared_prefix_blocks)]
    tables = [shared + [perm.pop() for _ in range(n)] for n in own]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    metadata = build_metadata(tables, seq_lens, query_lens, block_size)
    return query, kv_cache, metadata, head_dim**-0.5


# tile_min_rows: 0 = the op's default choice per item, 1 = every item on the tiled path (decode
# rows included), huge = every item on the per-key path.
PATHS = {"default": 0, "tiled": 1, "per_key": 1 << 30}


def check(seq_lens, query_lens, num_splits=0, paths=("default",), tile_rows=0, **kw):
    query, kv_cache, metadata, scale = random_case(seq_lens, query_lens, **kw)
    expected = paged_attention(query, kv_cache, metadata, scale)
    for isa in available_isas():
        for path in paths:
            out = cpu_op.paged_attention_cpu(query, kv_cache, metadata, scale, num_splits=num_splits, isa=isa,
                                             tile_min_rows=PATHS[path], tile_rows=tile_rows)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"isa {isa}, {path} path: {m}")


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_decode(block_size, head_dim):
    check([1, 17, 33, 100, 250], [1, 1, 1, 1, 1], block_size=block_size, head_dim=head_dim)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_chunked_prefill_over_cached_prefix(block_size):
    check([150, 64], [37, 64], block_size=block_size)  # a chunk after a prefix, a whole prompt


@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch(head_dim):
    check([75, 1, 300, 40, 19], [1, 1, 70, 40, 1], head_dim=head_dim, seed=3)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (9, 3), (8, 1), (32, 4)])
def test_mha_gqa_mqa(num_heads, num_kv_heads):
    check([45, 130, 9], [1, 20, 9], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=4)


# Decode items of the per-key path hold several KV heads (up to 16 rows): a whole group of heads
# (9 / 3), a remainder item (20 MHA heads: 16 + 4; 24 / 8 with groups of 3: 5 + 3 heads), and
# contexts that end inside a 16-key chunk and inside a block.
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (20, 20), (24, 8), (16, 4)])
@pytest.mark.parametrize("block_size,head_dim", [(8, 64), (16, 128), (32, 64)])
def test_decode_items_of_several_kv_heads(num_heads, num_kv_heads, block_size, head_dim):
    seq_lens, ones = [1, 15, 16, 17, 47, 129, 200], [1] * 7
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim, seed=11)
    check(seq_lens, ones, paths=("default", "per_key"), **kw)
    check(seq_lens, ones, num_splits=3, **kw)  # grouped items through the split merge


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_per_key_path_other_head_dims(head_dim):
    # The query held in passes of SCORE_QV vectors (AVX2: 80 = 8 + 2 vectors, 256 = 4 passes),
    # P.V register blocks narrower than the head with a one-vector remainder.
    check([140, 70, 17], [1, 2, 1], paths=("per_key",), head_dim=head_dim, seed=head_dim)


# PAGEDLLM_ATTN_PF (dist,mode,hint) only moves the per-key path's prefetches: none, a burst at
# each chunk's start, spread through P.V (the default), 1-3 chunks ahead, into L1 or L2; the
# output must not change. Block 8: a prefetched chunk spans two blocks; splits: items that start
# mid-context; a 16-bit cache: rows of 128 bytes.
@pytest.mark.parametrize("setting", ["0", "1,1,2", "1,2,3", "3,2,2", "2,1,3"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefetch_settings_do_not_change_the_output(monkeypatch, setting, block_size):
    monkeypatch.setenv("PAGEDLLM_ATTN_PF", setting)
    seq_lens, query_lens = [1, 17, 40, 129, 300], [1, 1, 3, 1, 2]
    check(seq_lens, query_lens, paths=("per_key",), block_size=block_size, seed=21)
    check(seq_lens, query_lens, num_splits=3, paths=("per_key",), block_size=block_size, seed=22)
    query, kv_cache, metadata, scale = random_case(seq_lens, query_lens, block_size=block_size, seed=23)
    kv16 = kv_cache.to(torch.float16)
    expected = paged_attention(query, kv16, metadata, scale)
    for isa in available_isas():
        out = cpu_op.paged_attention_cpu(query, kv16, metadata, scale, isa=isa, tile_min_rows=PATHS["per_key"])
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_short_chunks_per_key_path_grouped_heads():
    # 2 and 3 query rows x 3 heads: 6 / 9 rows per head, so items of 2 + 1 and of 1 KV head;
    # causal rows inside a chunk see different numbers of its keys.
    check([40, 33, 18], [2, 3, 3], paths=("default", "per_key"), seed=12)
    check([40, 33, 18], [2, 3, 3], num_splits=2, paths=("per_key",), seed=13)


def test_blocks_shared_by_several_sequences():
    check([70, 90, 66, 49], [1, 5, 1, 17], shared_prefix_blocks=3, seed=5)


def test_long_context_single_sequence_splits():
    check([3000], [1], seed=6)  # auto: too few items for the threads -> context splits
    check([3000, 517], [1, 1], num_splits=5, seed=7)  # forced splits, uneven last split
    check([700], [45], num_splits=4, seed=8)  # prefill rows past a split's keys get nothing there


def test_batch_of_one_token():
    check([1], [1])


def test_non_contiguous_query_from_fused_projection():
    query, kv_cache, metadata, scale = random_case([30, 12], [4, 1])
    fused = torch.cat([query, torch.randn_like(query)], dim=1)  # query as a strided view
    q = fused[:, : query.shape[1]]
    torch.testing.assert_close(cpu_op.paged_attention_cpu(q, kv_cache, metadata, scale),
                               paged_attention(query, kv_cache, metadata, scale), atol=1e-5, rtol=1e-5)


def test_backend_resolution_and_forced_fallback(monkeypatch):
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert isinstance(make_attention_backend("auto", "cpu"), CpuAttentionBackend)
    assert make_attention_backend("torch", "cpu").name == "torch"

    monkeypatch.setenv(cpu_op.DISABLE_ENV, "1")
    monkeypatch.setattr(cpu_op, "_state", {})
    assert not cpu_op.load()
    assert "PAGEDLLM_DISABLE_CPU_OP" in cpu_op.unavailable_reason()
    assert resolve_backend_name("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="unavailable"):
        resolve_backend_name("cpu", "cpu")


@pytest.mark.parametrize("seq_lens,query_lens", [
    ([60, 33], [1, 12]),  # decode rows and a short chunk
    ([60, 200, 9, 70, 48], [1, 40, 1, 5, 48]),  # long chunks (tiled) beside decode rows
    ([100, 64], [64, 64]),  # only long chunks
])
def test_backend_matches_reference(seq_lens, query_lens):
    query, kv_cache, metadata, scale = random_case(seq_lens, query_lens, seed=9)
    expected = paged_attention(query, kv_cache, metadata, scale)
    out = CpuAttentionBackend().forward(query, kv_cache, metadata, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_backend_falls_back_for_other_dtypes():
    query, kv_cache, metadata, scale = random_case([60, 33], [1, 12])
    backend = CpuAttentionBackend()
    expected = paged_attention(query, kv_cache, metadata, scale)
    out = backend.forward(query.double(), kv_cache.double(), metadata, scale)  # the reference handles it
    torch.testing.assert_close(out, expected.double(), atol=1e-5, rtol=1e-5)


# The per-key path scores a head's rows in register blocks of 3 (remainders of 2 and 1) and runs
# the online softmax a vector of rows at a time (8 on AVX2, 16 on AVX-512): groups of 2 and 4,
# rows past one vector (5 query rows x 4 = 20), causal rows that see none of a chunk's keys while
# other rows of the same vector do, and contexts of 1 and of a partial chunk.
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 2), (5, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_per_key_path_row_blocks_and_row_vectors(num_heads, num_kv_heads, block_size):
    check([1, 21, 90, 37], [1, 5, 4, 20], paths=("per_key",), num_heads=num_heads, num_kv_heads=num_kv_heads,
          block_size=block_size, seed=21)
    check([1, 21, 90, 37], [1, 5, 4, 20], num_splits=2, paths=("per_key",), num_heads=num_heads,
          num_kv_heads=num_kv_heads, block_size=block_size, head_dim=128, seed=22)


# The tiled path (long chunks): key tiles of 64 gathered through the table, register tiles of
# MR rows, causal limits inside a tile. Every case runs on both paths and every ISA.
BOTH = ("default", "tiled", "per_key")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_tiled_long_chunk_over_cached_prefix(head_dim, block_size):
    # 300 new tokens after a 437-token prefix (tiles straddle blocks and the prefix boundary),
    # a whole 129-token prompt, and decode rows in the same call.
    check([737, 129, 90, 33], [300, 129, 1, 1], paths=BOTH, head_dim=head_dim, block_size=block_size, seed=11)


@pytest.mark.parametrize("chunk", [17, 33, 63, 65, 97, 130])
def test_tiled_chunk_lengths_not_multiples_of_the_tiles(chunk):
    # Rows padded to the register tile, the last key tile partial, item tiles of uneven length.
    check([chunk + 70, chunk], [chunk, chunk], paths=BOTH, tile_rows=40, seed=chunk)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (9, 3), (8, 1), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tiled_mha_gqa_mqa(num_heads, num_kv_heads, head_dim):
    check([200, 150, 40], [120, 150, 1], paths=BOTH, num_heads=num_heads, num_kv_heads=num_kv_heads,
          head_dim=head_dim, seed=12)


def test_tiled_shared_blocks_and_splits():
    check([170, 190, 96], [60, 190, 1], paths=BOTH, shared_prefix_blocks=4, seed=13)
    check([900], [200], num_splits=3, paths=BOTH, seed=14)  # tiled items split over their keys


@pytest.mark.parametrize("tile_rows", [6, 50, 96, 400])
def test_tiled_item_sizes(tile_rows):
    check([520, 300], [512, 100], paths=("default", "tiled"), tile_rows=tile_rows, seed=15)


def test_tiled_other_head_dims():
    for head_dim in (32, 80, 96):  # register tiles wider than the head: the one-vector remainder
        check([140, 70], [100, 1], paths=("tiled",), head_dim=head_dim, num_heads=4, num_kv_heads=2, seed=head_dim)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_kv_write_matches_index_copy(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    kv_cache = torch.randn(2, 40, 16, 3, 64, generator=gen)
    qkv = torch.randn(num_tokens, (9 + 2 * 3) * 64, generator=gen)  # K and V as strided views, as the model has them
    key, value = qkv[:, 576:768].view(num_tokens, 3, 64), qkv[:, 768:].view(num_tokens, 3, 64)
    slots = torch.randperm(40 * 16, generator=gen)[:num_tokens]
    expected = kv_cache.clone()
    write_kv_cache(key, value, expected, slots)
    assert cpu_op.supports_kv_write(key, value, kv_cache)
    CpuAttentionBackend().write_kv_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


def test_kv_write_rejects_a_slot_past_the_cache():
    kv_cache = torch.zeros(2, 4, 16, 3, 64)
    key = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_op.kv_write_cpu(key, key, kv_cache, torch.tensor([3, 64]))
