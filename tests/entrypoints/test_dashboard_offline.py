"""The block map offline: LLM.kv_cache_snapshot / kv_cache_stats on a real (tiny) model, and
`bench memory`'s renderer drawing it to a PNG."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.memory import PeakKVMap, kv_map_colors, render_kv_map
from tests.engine.tiny_llama_dir import build_tiny_llama_dir


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))
    return LLM(str(model_dir), num_kv_blocks=32, block_size=16, max_model_len=256)


def test_snapshot_at_the_fullest_step_and_back_to_idle(llm, tmp_path):
    peak = PeakKVMap(llm)
    try:
        # three prompts of 20 tokens with n=2: each sample ends at 20 + 30 = 50 tokens
        outputs = llm.generate([[5 + i] * 20 for i in range(3)], SamplingParams(max_tokens=30, n=2, ignore_eos=True),
                               use_tqdm=False)
    finally:
        peak.detach()
    assert all(len(c.token_ids) == 30 for o in outputs for c in o.outputs)
    kv_map = peak.kv_map
    held = [b for b, ref in enumerate(kv_map.ref_cnts) if ref]
    assert len(held) == peak.num_used_blocks > 0 and len(kv_map.ref_cnts) == 32
    running = [r for r in kv_map.requests if r.state == "running"]
    assert running and sorted({b for r in running for b in r.block_ids}) == held
    # the samples of a prompt share its first (full) block
    assert max(kv_map.ref_cnts) >= 2
    for r in running:
        assert len(r.block_ids) == -(-r.num_computed_tokens // 16)
    # idle: nothing held, every full block of the prompts and outputs cached
    idle = llm.kv_cache_snapshot()
    stats = llm.kv_cache_stats()
    assert idle.requests == [] and not any(idle.ref_cnts)
    assert (stats.num_used_blocks, stats.num_filled_slots, stats.num_shared_blocks) == (0, 0, 0)
    assert stats.num_cached_blocks == len(idle.cached_block_ids) > 0
    assert stats.num_cached_blocks + stats.num_empty_blocks == 32

    colors = kv_map_colors(kv_map)
    grey = (0.33, 0.33, 0.33)
    assert sum(1 for c in colors if c != grey and c != (0.86, 0.92, 1.0)) == len(held)
    path = render_kv_map(kv_map, tmp_path / "kv_map.png", "peak")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000
