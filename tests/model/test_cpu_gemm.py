"""The compiled packed GEMM (csrc/cpu_gemm*.cpp) against ``x @ W^T (+ b)`` in float64.

Both kernels run here where the CPU has them (a weight packed 16 wide runs the AVX2 kernel even on
an AVX-512 CPU): every row count from 1 to 70 (every remainder of the row blocking, 14 rows on
AVX-512, 6 on AVX2), output widths that leave a ragged last panel, odd and tiny K, with and
without bias, a strided input, the refusals, and the layers' use of it and their fallback.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.layers import cpu_gemm
from pagedllm.model.layers.embedding import LMHead
from pagedllm.model.layers.linear import GEMM_ROWS, ColumnParallelLinear, RowParallelLinear
from tests.model.conftest import require_compiled_cpu_ops

ISAS = ["avx512", "avx2"]


@pytest.fixture(scope="module", autouse=True)
def compiled_ops():
    require_compiled_cpu_ops()
    if cpu_gemm.panel_width("best") == 0:
        pytest.skip("this CPU has no AVX2 + FMA: the compiled GEMM is off")


def need(isa: str) -> int:
    width = cpu_gemm.panel_width(isa)
    if width == 0:
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    return width


def rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check(x, w, b, y) -> None:
    """float32 summation order is the only difference allowed: a bound ~10x the rounding seen."""
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    k = x.shape[1]
    assert y.dtype == torch.float32 and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-6 * max(k, 16))


@pytest.fixture(params=[(0, 1), (1, 0), (8, 0)], ids=["default", "legacy", "chunks-to-8-blocks-near-only"])
def schedule(request):
    """Each row blocking under the default (chunked sweeps for 2-4 blocks, far prefetch), the
    previous whole-panel schedule without the far prefetch, and chunks up to 8 blocks (every row
    count below 70 on AVX2, to 56+ on AVX-512) without it."""
    chunks, far = request.param
    previous = cpu_gemm.chunk_max_blocks(chunks), cpu_gemm.far_prefetch(far)
    yield request.param
    cpu_gemm.chunk_max_blocks(previous[0])
    cpu_gemm.far_prefetch(previous[1])


def test_tuning_settings_round_trip():
    default = cpu_gemm.chunk_max_blocks(-1)
    assert default >= 2
    assert cpu_gemm.chunk_max_blocks(1) == default and cpu_gemm.chunk_max_blocks(-1) == 1
    assert cpu_gemm.chunk_max_blocks(0) == 1 and cpu_gemm.chunk_max_blocks(-1) == default
    assert cpu_gemm.far_prefetch(-1) == 1
    assert cpu_gemm.far_prefetch(0) == 1 and cpu_gemm.far_prefetch(-1) == 0
    assert cpu_gemm.far_prefetch(1) == 0 and cpu_gemm.far_prefetch(-1) == 1


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [67, 301])  # odd K (the split-K tail); 301: chunks of 101, 101, 99
def test_every_row_count_ragged_panels(isa, bias, k, schedule):
    width = need(isa)
    n = 3 * width + 5  # a ragged last panel
    w, b = rand(n, k, seed=1), (rand(n, seed=2) if bias else None)
    packed = cpu_gemm.pack(w, isa)
    assert packed.shape == (4, k, width)
    assert torch.equal(packed[3, :, 5:], torch.zeros(k, width - 5)), "padding columns must be zero"
    for m in range(1, 71):
        x = rand(m, k, seed=m)
        check(x, w, b, cpu_gemm.gemm(x, packed, b, n))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, k", [(5, 1), (7, 3), (40, 2), (960, 576), (576, 1536), (33, 1000)])
def test_shapes(isa, n, k):
    need(isa)
    w, b = rand(n, k, seed=n), rand(n, seed=k)
    packed = cpu_gemm.pack(w.t().contiguous().t(), isa)  # column-major storage, as linear.py keeps it
    for m in (1, 2, 3, 5, 14, 15, 16, 24, 29, 32, 48, 56, 57, 64):
        x = rand(m, k, seed=m + n)
        check(x, w, b, cpu_gemm.gemm(x, packed, b, n))
        check(x, w, None, cpu_gemm.gemm(x, packed, None, n))


def test_strided_rows_zero_rows_and_refusals():
    w = rand(100, 64, seed=3)
    packed = cpu_gemm.pack(w)
    for rows in (9, 20):  # one row block; two (x packed per chunk from the strided rows)
        wide = rand(rows, 80, seed=4)
        x = wide[:, 8:72]  # row stride 80, dense rows: used in place
        check(x, w, None, cpu_gemm.gemm(x, packed, None, 100))
    assert cpu_gemm.gemm(torch.empty(0, 64), packed, None, 100).shape == (0, 100)
    with pytest.raises(RuntimeError, match="rows must be dense"):
        cpu_gemm.gemm(rand(64, 9, seed=5).t(), packed, None, 100)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_gemm.gemm(rand(3, 63, seed=5), packed, None, 100)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_gemm.gemm(rand(3, 64, seed=5), packed, rand(99, seed=6), 100)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_gemm.gemm(rand(3, 64, seed=5), packed, None, 200)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_gemm.gemm(rand(3, 64, seed=5).double(), packed, None, 100)
    assert cpu_gemm.pack(w.double()) is None
    with pytest.raises(ValueError, match="avx512, avx2"):
        cpu_gemm.pack(w, "sse")


def _column_linear(bias: bool) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(96, 200, bias=bias)
    layer.weight.data.copy_(rand(200, 96, seed=7))
    if bias:
        layer.bias.data.copy_(rand(200, seed=8))
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_linear_uses_it_within_its_rows(bias, monkeypatch):
    layer = _column_linear(bias)
    original_w = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer.gemm_weight is not None and layer.packed_weight is None, "one packed copy, not two"
    calls = []
    real = layer._gemm_op  # the op, bound once by process_weights_after_loading
    monkeypatch.setattr(layer, "_gemm_op", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 14, GEMM_ROWS[1], GEMM_ROWS[1] + 1):
        x = rand(m, 96, seed=m)
        check(x, original_w, layer.bias, layer(x))
    assert calls == [1, 14, GEMM_ROWS[1]]


def test_row_parallel_and_lm_head():
    down = RowParallelLinear(150, 64, bias=True)
    down.weight.data.copy_(rand(64, 150, seed=9))
    down.bias.data.copy_(rand(64, seed=10))
    w = down.weight.detach().clone()
    down.process_weights_after_loading()
    assert down.gemm_weight is not None
    x = rand(14, 150, seed=11)
    check(x, w, down.bias, down(x))
    head = LMHead(1000, 64)
    head.weight.data.copy_(rand(1000, 64, seed=12))
    head.process_weights_after_loading()
    assert head.gemm_weight is not None and head.packed_weight is None
    for m in (1, 14, 300):
        h = rand(m, 64, seed=m)
        check(h, head.weight, None, head.compute_logits(h))


def test_switched_off_keeps_the_previous_path(monkeypatch):
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "1")
    layer = _column_linear(True)
    w = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer.gemm_weight is None
    assert (layer.packed_weight is not None) == hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    x = rand(14, 96, seed=13)
    torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), rtol=1e-5, atol=1e-5)


def test_forced_avx2_packs_16_wide(monkeypatch):
    need("avx2")
    monkeypatch.setenv(cpu_gemm.ISA_ENV, "avx2")
    layer = _column_linear(True)
    w = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer.gemm_weight.shape[2] == 16
    x = rand(20, 96, seed=14)
    check(x, w, layer.bias, layer(x))


def test_packed_weights_share_huge_page_chunks_in_order():
    from pagedllm.model import huge_pages

    cpu_gemm._arena.update(last=None, end=0, limit=0)  # start a fresh chunk
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (100, 33)]
    ws = [rand(n, k, seed=n + k) for n, k in shapes]
    packs = [cpu_gemm.pack(w) for w in ws]
    width = packs[0].shape[2]
    first = packs[0].data_ptr()
    if huge_pages.available():
        assert first % huge_pages.HUGE_PAGE_BYTES == 0, "a new chunk starts on a huge page"
    for prev, cur in zip(packs, packs[1:]):
        assert cur.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr(), "one chunk"
        gap = cur.data_ptr() - (prev.data_ptr() + prev.numel() * 4)
        assert cur.data_ptr() % 64 == 0 and 0 <= gap < 64, "adjacent, in packing order, line-aligned"
    for (n, k), w, p in zip(shapes, ws, packs):
        assert p.is_contiguous() and p.shape == (-(-n // width), k, width)
        x = rand(16, k, seed=k)
        check(x, w, None, cpu_gemm.gemm(x, p, None, n))
    # A weight over a quarter chunk gets its own buffer; the chunk goes on after it.
    big = cpu_gemm.pack(rand(cpu_gemm.ARENA_CHUNK_FLOATS // 4 // 64 + 64, 64, seed=1))
    assert big.untyped_storage().data_ptr() != first
    after = cpu_gemm.pack(ws[1])
    assert after.data_ptr() == -(-(packs[-1].data_ptr() + packs[-1].numel() * 4) // 64) * 64
    # The arena holds no strong reference: once every slice is gone, so is the chunk.
    del packs, after, p
    assert cpu_gemm._arena["last"]() is None
