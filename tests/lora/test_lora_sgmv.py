"""The compiled segmented LoRA kernel (csrc/lora_sgmv*.cpp) against the float64 product of each segment's own
slot, both ISAs where the CPU has them: ragged segments (empty, single rows, every remainder of the 4-row
blocks), ranks differing per slot (0 too) and not multiples of a vector, parts of odd widths, rows outside
every segment left untouched, a strided x, the refusals; and LoRASlots.apply's torch fallback against it."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.lora.layers import LoRASlots, LoRAStep, lora_step
from tests.model.conftest import require_compiled_cpu_ops

ISAS = {"avx2": 1, "avx512": 2}


@pytest.fixture(scope="module", autouse=True)
def compiled_ops():
    require_compiled_cpu_ops()
    if torch.ops.pagedllm.lora_sgmv_isa(0) == 0:
        pytest.skip("this CPU has no AVX2 + FMA: the LoRA kernel is off")


def need(isa: str) -> int:
    code = ISAS[isa]
    if torch.ops.pagedllm.lora_sgmv_isa(code) != code:
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    return code


def make_slots(k: int, parts: list[int], ranks: list[int], max_rank: int, seed: int) -> LoRASlots:
    """Slots holding random adapters of `ranks` (0: the slot is empty) on every part."""
    g = torch.Generator().manual_seed(seed)
    slots = LoRASlots(k, parts, len(ranks), max_rank, torch.float32, torch.device("cpu"))
    for slot, r in enumerate(ranks):
        if r:
            slots.set_slot(slot, r, [(torch.randn(r, k, generator=g), torch.randn(size, r, generator=g))
                                     for size in parts])
    return slots


def reference(x, y, slots: LoRASlots, segments: list[int]) -> torch.Tensor:
    """y + each segment's (x A_s) B_s in float64, part by part from the slot's own columns."""
    out = y.double().clone()
    for begin, end, slot in zip(segments[0::3], segments[1::3], segments[2::3]):
        r = int(slots.ranks[slot])
        a, b = slots.slot_a(slot).double(), slots.slot_b(slot).double()
        for p, (offset, size) in enumerate(zip(slots.part_offsets, slots.part_sizes)):
            cols = slice(p * r, (p + 1) * r)
            out[begin:end, offset:offset + size] += (x[begin:end].double() @ a[:, cols]) @ b[cols, offset:offset + size]
    return out


def run(x, y, slots: LoRASlots, segments: list[int], isa: int) -> torch.Tensor:
    torch.ops.pagedllm.lora_sgmv_cpu(x, y, slots.a, slots.b, slots.ranks, slots.part_sizes, segments, isa)
    return y


def check(y, ref, k: int, max_rank: int) -> None:
    """float32 summation order is the only difference allowed: a bound ~10x the rounding seen."""
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * (k + max_rank) * 4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("parts, k", [([37], 29), ([24, 8, 8], 64), ([45, 3], 7), ([100, 30, 30], 129)],
                         ids=["one-part", "qkv", "gate-up-odd", "qkv-wide"])
def test_ragged_segments_and_ranks_per_slot(isa, parts, k):
    code = need(isa)
    ranks = [8, 0, 3, 16, 1, 5]  # slot 1 empty; ranks off the vector width; one past 2 vectors of 8
    slots = make_slots(k, parts, ranks, 16, seed=len(parts) * 100 + k)
    # rows 0-1 base; empty segments; single rows; every remainder of the 4-row blocks; a slot twice; the
    # empty slot's rows 15-16 (nothing to add); rows 29-30 after the last segment base again
    segments = [2, 2, 0, 2, 3, 0, 3, 8, 2, 8, 8, 3, 8, 15, 3, 15, 17, 1, 17, 18, 4, 18, 24, 5, 24, 29, 0]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(31, k, generator=g)
    y = torch.randn(31, sum(parts), generator=g)
    ref = reference(x, y, slots, segments)
    out = run(x, y.clone(), slots, segments, code)
    check(out, ref, k, 16)
    for rows in (slice(0, 2), slice(15, 17), slice(29, 31)):  # no adapter (or an empty slot) there
        assert torch.equal(out[rows], y[rows])
    assert not torch.equal(out[3:8], y[3:8])  # the test can fail: the deltas are there


@pytest.mark.parametrize("isa", ISAS)
def test_random_layouts(isa):
    code = need(isa)
    rng = random.Random(isa)
    for trial in range(60):
        num_slots, max_rank = rng.randint(1, 5), rng.choice([1, 3, 8, 16, 20])
        parts = rng.choice([[13], [16, 8, 8], [45, 3], [64], [33, 7, 7]])
        k, num_rows = rng.choice([1, 5, 64, 129]), rng.randint(0, 40)
        slots = make_slots(k, parts, [rng.randint(0, max_rank) for _ in range(num_slots)], max_rank, seed=trial)
        cuts = sorted(rng.randint(0, num_rows) for _ in range(rng.randint(0, 5)))
        segments, previous = [], rng.randint(0, cuts[0]) if cuts else 0
        for cut in cuts:
            segments += [previous, cut, rng.randrange(num_slots)]
            previous = cut
        g = torch.Generator().manual_seed(trial)
        x, y = torch.randn(num_rows, k, generator=g), torch.randn(num_rows, sum(parts), generator=g)
        check(run(x, y.clone(), slots, segments, code), reference(x, y, slots, segments), k, max_rank)


@pytest.mark.parametrize("isa", ISAS)
def test_large_steps_use_the_pool_and_agree_with_one_row_at_a_time(isa):
    """Past the serial threshold the passes are split across threads; each row's sums keep their order, so
    a row's result does not depend on the other rows (batch-invariant), bit for bit."""
    code = need(isa)
    slots = make_slots(576, [576, 192, 192], [16, 8, 16, 4], 16, seed=3)
    segments = [0, 40, 0, 40, 41, 1, 41, 120, 2, 120, 200, 3]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(200, 576, generator=g), torch.randn(200, 960, generator=g)
    whole = run(x, y.clone(), slots, segments, code)
    check(whole, reference(x, y, slots, segments), 576, 16)
    for row in (0, 39, 40, 41, 119, 120, 199):
        slot = next(s for b, e, s in zip(segments[0::3], segments[1::3], segments[2::3]) if b <= row < e)
        alone = run(x[row:row + 1], y[row:row + 1].clone(), slots, [0, 1, slot], code)
        assert torch.equal(alone, whole[row:row + 1]), row


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("segments, num_rows", [([0, 18, 0], 18), ([0, 5, 0, 9, 13, 1, 13, 18, 2], 18),
                                                ([2, 3, 0, 3, 40, 1], 41), ([0, 3, 1], 3)],
                         ids=["decode-one-adapter", "decode-three-adapters", "a long segment", "one-task"])
def test_one_pass_row_tasks_and_two_passes_agree_bit_for_bit(isa, segments, num_rows):
    """With two threads and rows for a task each, the op runs one pass over row tasks (one pool job); with one
    thread, the two passes (shrink units, then expand blocks): the same sums in the same order."""
    code = need(isa)
    slots = make_slots(576, [1536, 1536], [16, 8, 16], 16, seed=7)
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(num_rows, 576, generator=g), torch.randn(num_rows, 3072, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        two_passes = run(x, y.clone(), slots, segments, code)
        torch.set_num_threads(2)
        one_pass = run(x, y.clone(), slots, segments, code)
    finally:
        torch.set_num_threads(threads)
    check(one_pass, reference(x, y, slots, segments), 576, 16)
    assert torch.equal(one_pass, two_passes)


@pytest.mark.parametrize("isa", ISAS)
def test_prefetch_changes_no_bit(isa):
    """The one-pass split's software prefetch (the next task's A, this task's B) only moves data: on and off
    give the same bits, with ranks under max_rank (B's rows strided) and several tasks per thread."""
    code = need(isa)
    slots = make_slots(576, [576, 192, 192], [16, 5, 12, 1], 16, seed=9)
    g = torch.Generator().manual_seed(13)
    x, y = torch.randn(18, 576, generator=g), torch.randn(18, 960, generator=g)
    segments = [0, 5, 0, 5, 10, 1, 10, 14, 2, 14, 18, 3]
    threads, before = torch.get_num_threads(), torch.ops.pagedllm.lora_sgmv_prefetch(-1)
    try:
        torch.set_num_threads(2)
        torch.ops.pagedllm.lora_sgmv_prefetch(1)
        on = run(x, y.clone(), slots, segments, code)
        torch.ops.pagedllm.lora_sgmv_prefetch(0)
        off = run(x, y.clone(), slots, segments, code)
    finally:
        torch.set_num_threads(threads)
        torch.ops.pagedllm.lora_sgmv_prefetch(before)
    check(on, reference(x, y, slots, segments), 576, 16)
    assert torch.equal(on, off)


def test_slot_arena_hands_out_aligned_zeroed_views():
    from pagedllm.lora.layers import SlotArena
    from pagedllm.model import huge_pages

    shapes = [(2, 3, 576, 16), (2, 60, 16, 16), (1, 5, 7)]
    arena = SlotArena(SlotArena.nbytes(shapes, torch.float32), torch.device("cpu"))
    taken = [arena.take(shape, torch.float32) for shape in shapes]
    assert [t.shape for t in taken] == shapes and all(t.data_ptr() % 64 == 0 and not t.any() for t in taken)
    taken[1].fill_(1)
    assert not taken[0].any() and not taken[2].any()
    if huge_pages.available():  # over huge_pages.MIN_BYTES: its own 2 MB-aligned mapping
        big = SlotArena(huge_pages.MIN_BYTES, torch.device("cpu"))
        assert big.buffer.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    with pytest.raises(AssertionError, match="sized for fewer"):
        arena.take((1,), torch.float32)


def test_strided_rows_of_x_and_y():
    slots = make_slots(32, [16, 8], [4, 2], 4, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=g)[:, :32]  # row stride 40
    y = torch.randn(6, 30, generator=g)[:, 2:26]  # row stride 30
    segments = [0, 3, 1, 3, 6, 0]
    ref = reference(x, y, slots, segments)
    check(run(x, y, slots, segments, 0), ref, 32, 4)


def test_refusals():
    slots = make_slots(16, [8, 8], [4, 2], 4, seed=1)
    x, y = torch.randn(5, 16), torch.randn(5, 16)
    op = torch.ops.pagedllm.lora_sgmv_cpu
    with pytest.raises(RuntimeError, match="outside"):
        op(x, y, slots.a, slots.b, slots.ranks, [8, 8], [3, 6, 0], 0)
    with pytest.raises(RuntimeError, match="slot 2 of 2"):
        op(x, y, slots.a, slots.b, slots.ranks, [8, 8], [0, 1, 2], 0)
    with pytest.raises(RuntimeError, match="cover 15 columns"):
        op(x, y, slots.a, slots.b, slots.ranks, [8, 7], [0, 1, 0], 0)
    with pytest.raises(RuntimeError, match="triples"):
        op(x, y, slots.a, slots.b, slots.ranks, [8, 8], [0, 1], 0)
    with pytest.raises(RuntimeError, match="rank 5 does not fit"):
        op(x, y, slots.a, slots.b, torch.tensor([5, 0]), [8, 8], [0, 1, 0], 0)
    with pytest.raises(RuntimeError, match="take 2 panels of b, b has 1"):
        op(x, torch.randn(5, 16), slots.a, slots.b[:, :1].contiguous(), slots.ranks, [8, 8], [0, 1, 0], 0)
    with pytest.raises(RuntimeError, match="a must be"):
        op(x, y, slots.a.transpose(1, 2), slots.b, slots.ranks, [8, 8], [0, 1, 0], 0)
    with pytest.raises(RuntimeError, match="x has 5 rows"):
        op(x, y[:4], slots.a, slots.b, slots.ranks, [8, 8], [0, 1, 0], 0)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), y, slots.a, slots.b, slots.ranks, [8, 8], [0, 1, 0], 0)


def test_slots_apply_the_kernel_and_the_torch_fallback_alike():
    """LoRASlots.apply through the op, and through its torch path (what another device or dtype runs)."""
    slots = make_slots(48, [32, 16, 16], [8, 3, 0], 8, seed=4)
    assert slots.compiled
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(12, 48, generator=g), torch.randn(12, 64, generator=g)
    segments = [1, 5, 0, 5, 6, 1, 6, 9, 2, 9, 12, 0]
    ref = reference(x, y, slots, segments)
    with lora_step(LoRAStep(segments)):
        check(slots.apply(x, y.clone()), ref, 48, 8)
        slots._op = None
        check(slots.apply(x, y.clone()), ref, 48, 8)
    assert torch.equal(slots.apply(x, y.clone()), y)  # outside a step: nothing added
