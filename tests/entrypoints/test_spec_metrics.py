"""Speculative-decoding counters reach /metrics (as increments of the core's cumulative counts), and
--speculative-config is a flag of the server and the offline CLI."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.engine.protocol import EngineStatsMsg
from pagedllm.metrics.prometheus import ServerMetrics


def _stats(**spec) -> EngineStatsMsg:
    return EngineStatsMsg(num_running=1, num_waiting=0, kv_cache_usage=0.1, num_preemptions=0,
                          prefix_cache_queries=0, prefix_cache_hits=0, num_evictions=0, **spec)


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def test_spec_decode_counters_on_metrics():
    metrics = ServerMetrics("m")
    metrics.record_engine_stats(_stats(spec_num_steps=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=7,
                                       spec_num_bonus_tokens=4, spec_accepted_per_position=[4, 2, 1],
                                       spec_proposed_per_position=[4, 4, 4]))
    metrics.record_engine_stats(_stats(spec_num_steps=5, spec_num_draft_tokens=15, spec_num_accepted_tokens=10,
                                       spec_num_bonus_tokens=5, spec_accepted_per_position=[5, 3, 2],
                                       spec_proposed_per_position=[5, 5, 5]))
    text = metrics.render().decode()
    assert _value(text, "pagedllm_spec_decode_num_draft_tokens_total") == 15
    assert _value(text, "pagedllm_spec_decode_num_accepted_tokens_total") == 10
    assert _value(text, "pagedllm_spec_decode_num_bonus_tokens_total") == 5
    assert _value(text, "pagedllm_spec_decode_num_steps_total") == 5
    assert 'pagedllm_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0' in text
    assert 'pagedllm_spec_decode_num_proposed_tokens_per_pos_total{model_name="m",position="0"} 5.0' in text


def test_speculative_config_flag():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                                      '"prompt_lookup_max": 3}'])
    assert EngineArgs.from_cli_args(args).speculative() == SpeculativeConfig("ngram", 4, 1, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])
    assert EngineArgs.from_cli_args(parser.parse_args([])).speculative() is None
