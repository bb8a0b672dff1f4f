"""Buffers on transparent huge pages: same values and shapes as torch.empty/zeros, 2 MB-aligned where
the kernel allows huge pages, plain tensors where it does not or when switched off."""

import pytest
import torch

from pagedllm.model import huge_pages
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_kv_caches

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")


@needs_thp
def test_large_buffer_is_aligned_contiguous_and_writable():
    t = huge_pages.empty((3, 1000, 1000), torch.float32)
    assert t.shape == (3, 1000, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    assert t[2, 999, 999].item() == t.numel() - 1


def _huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps), in bytes."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _thp_fault_counts() -> dict[str, int]:
    counts = {}
    for line in open("/proc/vmstat"):
        name, value = line.split()
        if name in ("thp_fault_alloc", "thp_fault_fallback"):
            counts[name] = int(value)
    return counts


@needs_thp
def test_touched_buffer_lands_on_huge_pages():
    before = _thp_fault_counts()
    t = huge_pages.zeros((16, 2**20), torch.float32)  # 64 MB
    after = _thp_fault_counts()
    assert t.abs().sum().item() == 0.0
    # Its own mapping, not the process total (other tests' buffers may be freed meanwhile).
    on_huge = _huge_bytes_of_mapping(t.data_ptr())
    if on_huge == 0 and after.get("thp_fault_fallback", 0) > before.get("thp_fault_fallback", 0):
        pytest.skip("the kernel had no free 2 MB pages just now (thp_fault_fallback rose): nothing to check")
    assert on_huge >= huge_pages.HUGE_PAGE_BYTES


def test_small_buffers_and_the_switch_give_plain_tensors(monkeypatch):
    small = huge_pages.empty((10, 10), torch.float16)
    assert small.shape == (10, 10) and small.dtype == torch.float16 and small.storage_offset() == 0
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "1")
    assert not huge_pages.available()
    big = huge_pages.zeros((4, 2**20), torch.bfloat16)
    assert big.untyped_storage().nbytes() == big.numel() * 2 and big.abs().sum().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_kv_caches_are_zeroed_and_shaped(dtype):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    caches = allocate_kv_caches(spec, num_blocks=700)
    assert len(caches) == 2
    for cache in caches:
        assert cache.shape == (2, 700, 16, 3, 64) and cache.dtype == dtype and cache.is_contiguous()
        assert cache.abs().sum().item() == 0.0
    caches[0][1, 5, 3] = 1.0
    assert caches[1].abs().sum().item() == 0.0  # distinct buffers
