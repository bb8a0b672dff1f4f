"""KV occupancy gauges on /metrics: the engine's stats become labelled Prometheus gauges (vLLM-style names kept
where the project already had them), the block map is kept per replica, and a real server reports them."""

from __future__ import annotations

import re

import httpx
import pytest

from pagedllm.engine.protocol import EngineStatsMsg, KVMapMsg
from pagedllm.metrics.prometheus import MAX_PRIORITY_LABELS, ServerMetrics


def _stats(**kv) -> EngineStatsMsg:
    return EngineStatsMsg(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_preemptions=0,
                          prefix_cache_queries=0, prefix_cache_hits=0, num_evictions=0, **kv)


def parse(text: str) -> dict[str, float]:
    """'name{labels}' -> value."""
    values = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([-+0-9.eEinfNa]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def test_occupancy_gauges_render_with_their_labels():
    metrics = ServerMetrics("m")
    metrics.record_engine_stats(_stats(
        kv_num_blocks=10, kv_num_used_blocks=4, kv_num_cached_blocks=2, kv_num_empty_blocks=4,
        kv_num_filled_slots=13, kv_num_allocated_slots=16, kv_num_shared_blocks=2, kv_num_saved_blocks=3,
        kv_saved_bytes=3072, kv_num_host_blocks=8, kv_num_swapped_blocks=5, kv_blocks_by_priority={0: 5, -3: 2},
        num_swap_outs=1, num_scheduled_tokens=40))
    m = parse(metrics.render().decode())
    assert m['pagedllm_kv_cache_num_blocks{model_name="m"}'] == 10
    assert m['pagedllm_kv_cache_blocks{model_name="m",state="used"}'] == 4
    assert m['pagedllm_kv_cache_blocks{model_name="m",state="cached"}'] == 2
    assert m['pagedllm_kv_cache_blocks{model_name="m",state="free"}'] == 4
    assert m['pagedllm_kv_cache_token_slots{model_name="m",state="filled"}'] == 13
    assert m['pagedllm_kv_cache_token_slots{model_name="m",state="allocated"}'] == 16
    assert m['pagedllm_kv_cache_shared_blocks{model_name="m"}'] == 2
    assert m['pagedllm_kv_cache_sharing_saved_blocks{model_name="m"}'] == 3
    assert m['pagedllm_kv_cache_sharing_saved_bytes{model_name="m"}'] == 3072
    assert m['pagedllm_kv_cache_swap_num_blocks{model_name="m"}'] == 8
    assert m['pagedllm_kv_cache_swapped_blocks{model_name="m"}'] == 5
    assert m['pagedllm_kv_cache_blocks_by_priority{model_name="m",priority="0"}'] == 5
    assert m['pagedllm_kv_cache_blocks_by_priority{model_name="m",priority="-3"}'] == 2
    assert m['pagedllm_num_swap_outs_total{model_name="m"}'] == 1
    assert m['pagedllm_engine_tokens_computed_total{model_name="m"}'] == 40
    # the names the project already exposed stay (vLLM's meanings: usage counts held blocks)
    assert m['pagedllm_kv_cache_usage_ratio{model_name="m"}'] == 0.5
    assert m['pagedllm_num_requests_running{model_name="m"}'] == 2
    assert m['pagedllm_num_requests_waiting{model_name="m"}'] == 1
    # idle: every gauge back to 0, a priority that holds nothing any more reads 0 (not its last value)
    metrics.record_engine_stats(_stats(kv_num_blocks=10, kv_num_cached_blocks=6, kv_num_empty_blocks=4,
                                       num_swap_outs=1, num_scheduled_tokens=45))
    m = parse(metrics.render().decode())
    assert m['pagedllm_kv_cache_blocks{model_name="m",state="used"}'] == 0
    assert m['pagedllm_kv_cache_token_slots{model_name="m",state="filled"}'] == 0
    assert m['pagedllm_kv_cache_blocks_by_priority{model_name="m",priority="-3"}'] == 0
    assert m['pagedllm_engine_tokens_computed_total{model_name="m"}'] == 45


def test_priority_labels_are_bounded():
    metrics = ServerMetrics("m")
    metrics.record_engine_stats(_stats(kv_blocks_by_priority={p: 1 for p in range(MAX_PRIORITY_LABELS + 10)}))
    m = parse(metrics.render().decode())
    labels = [k for k in m if k.startswith("pagedllm_kv_cache_blocks_by_priority{")]
    assert len(labels) == MAX_PRIORITY_LABELS + 1
    assert m['pagedllm_kv_cache_blocks_by_priority{model_name="m",priority="other"}'] == 10


def test_block_maps_are_kept_per_replica():
    kv_map = KVMapMsg(1.0, 4, [1, 0], [3, 0], [], [], 1, 3, 0, 0, 0, 0)
    metrics = ServerMetrics("m")
    metrics.record_engine_stats(_stats(kv_map=kv_map))
    assert metrics.kv_maps == {"0": kv_map}
    dp = ServerMetrics("m")
    dp.record_replica_stats("1", _stats(kv_map=kv_map, kv_num_used_blocks=1))
    dp.record_engine_stats(_stats())  # a data-parallel total carries no map
    assert dp.kv_maps == {"1": kv_map}
    assert parse(dp.render().decode())['pagedllm_replica_kv_cache_blocks{model_name="m",replica="1",state="used"}'] == 1
    dp.record_replica_up("1", False)
    assert dp.kv_maps == {}


@pytest.mark.slow
def test_metrics_over_http_count_a_running_requests_blocks(tmp_path):
    from tests.engine.tiny_llama_dir import build_tiny_llama_dir
    from tests.entrypoints.server_helpers import RemoteServer

    model_dir = build_tiny_llama_dir(tmp_path / "model")
    srv = RemoteServer(model_dir, ["--num-kv-blocks", "64", "--block-size", "16", "--max-model-len", "512"],
                       tmp_path / "server.log")
    try:
        m = parse(httpx.get(f"{srv.url}/metrics", timeout=10).text)
        assert m['pagedllm_kv_cache_num_blocks{model_name="model"}'] == 64
        assert m['pagedllm_kv_cache_blocks{model_name="model",state="free"}'] == 64
        # a 40-token prompt and 200 tokens of output: 240 tokens = 15 blocks of 16 at the end
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{srv.url}/v1/completions", json={
                    "model": "model", "prompt": [5] * 40, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                seen = []
                for line in r.iter_lines():
                    if line.startswith("data: ") and len(seen) < 3:
                        m = parse(httpx.get(f"{srv.url}/metrics", timeout=10).text)
                        used = m['pagedllm_kv_cache_blocks{model_name="model",state="used"}']
                        filled = m['pagedllm_kv_cache_token_slots{model_name="model",state="filled"}']
                        allocated = m['pagedllm_kv_cache_token_slots{model_name="model",state="allocated"}']
                        if used:
                            seen.append((used, filled, allocated))
        assert seen, "no scrape saw the request's blocks"
        for used, filled, allocated in seen:  # while it ran: its blocks, filled up to its computed tokens
            assert allocated == used * 16 and allocated - 16 < filled <= allocated and filled >= 40
        m = srv.wait_idle_without_leaks()
        text = parse(httpx.get(f"{srv.url}/metrics", timeout=10).text)
        assert text['pagedllm_kv_cache_blocks{model_name="model",state="used"}'] == 0
        assert text['pagedllm_kv_cache_token_slots{model_name="model",state="filled"}'] == 0
        # 239 computed tokens: 14 full blocks stay cached for the next prompt
        assert text['pagedllm_kv_cache_blocks{model_name="model",state="cached"}'] == 14
        assert text['pagedllm_kv_cache_blocks{model_name="model",state="free"}'] == 50
        assert text['pagedllm_engine_tokens_computed_total{model_name="model"}'] == 239
    finally:
        srv.stop()
