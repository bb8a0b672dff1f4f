"""ParallelConfig is validated once, from EngineArgs; one function gives every head shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.config import EngineArgs, ParallelConfig
from pagedllm.distributed.shapes import TPShape, config_tp_shape, head_dim_of, num_kv_heads_of


SECRET = "s3cret-s3cret-s3cret"


def test_parallel_config_is_built_from_engine_args_and_frozen():
    config = EngineArgs(tensor_parallel_size=4, master_port=29512, num_local_workers=2,
                        distributed_timeout=30.0, distributed_secret=SECRET).parallel_config()
    assert config == ParallelConfig(4, "127.0.0.1", 29512, 2, 30.0, SECRET)
    assert config.num_local == 2 and ParallelConfig(3).num_local == 3
    with pytest.raises(AttributeError):
        config.tensor_parallel_size = 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=2, num_local_workers=3), r"num_local_workers must be in \[0, 2\]"),
    (dict(num_local_workers=-1), r"num_local_workers must be in \[0, 1\]"),
    (dict(master_port=70000), "master_port"),
    (dict(distributed_timeout=0), "distributed_timeout must be > 0"),
    (dict(tensor_parallel_size=2, num_local_workers=1), "needs a shared secret: set PAGEDLLM_DISTRIBUTED_SECRET"),
    (dict(tensor_parallel_size=2, distributed_secret="short"), "at least 16 characters"),
])
def test_parallel_config_rejects_what_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def _config(**fields):
    base = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=512, intermediate_size=1024,
                num_hidden_layers=2)
    return SimpleNamespace(**{**base, **fields})


def test_head_shapes_come_from_one_place():
    assert head_dim_of(_config()) == 64
    assert head_dim_of(_config(head_dim=128)) == 128  # an explicit head_dim wins (e.g. Qwen3, Gemma)
    assert num_kv_heads_of(_config()) == 4 and num_kv_heads_of(_config(num_key_value_heads=None)) == 8
    assert config_tp_shape(_config(), 2, 1) == TPShape(num_heads=4, num_kv_heads=2, kv_head_start=2)
    assert config_tp_shape(_config(), 8, 5).num_kv_heads == 1  # replicated: 8 ranks over 4 KV heads
    with pytest.raises(ValueError, match="valid sizes: 1, 2, 4, 8"):
        config_tp_shape(_config(), 3)


def test_the_secret_comes_from_the_flag_or_the_environment_and_stays_out_of_reprs(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_DISTRIBUTED_SECRET", raising=False)
    assert EngineArgs(tensor_parallel_size=2).parallel_config().distributed_secret is None  # local: random later
    monkeypatch.setenv("PAGEDLLM_DISTRIBUTED_SECRET", SECRET)
    args = EngineArgs(tensor_parallel_size=2, num_local_workers=0)
    assert args.parallel_config().distributed_secret == SECRET
    flagged = EngineArgs(tensor_parallel_size=2, num_local_workers=0, distributed_secret="f" * 16)
    assert flagged.parallel_config().distributed_secret == "f" * 16  # the flag wins
    assert "f" * 16 not in repr(flagged) and SECRET not in repr(args.parallel_config())
