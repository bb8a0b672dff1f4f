"""Each setting is declared once, in its runtime config; EngineArgs and the flags copy it, and each config
validates its own fields, once, with errors naming the field."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

import pagedllm.config as config
from pagedllm.config import (
    CacheConfig,
    EngineArgs,
    ParallelConfig,
    RequestLimits,
    SchedulerConfig,
    field_docs,
)
from pagedllm.entrypoints.openai.cli_args import ServerConfig

RUNTIME_CONFIGS = (CacheConfig, SchedulerConfig, ParallelConfig, RequestLimits)
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize("config_cls", RUNTIME_CONFIGS, ids=lambda c: c.__name__)
def test_every_runtime_setting_is_an_engine_arg_copied_from_its_config(config_cls):
    docs = field_docs(config_cls)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flag_help = {a.dest: a.help for a in parser._actions if a.option_strings and a.option_strings[0] != "--no-prefix-caching"}
    for f in dataclasses.fields(config_cls):
        copy = ENGINE_FIELDS[f.name]
        assert copy.metadata["owner"] is config_cls, f"EngineArgs.{f.name} is declared again, not setting()"
        assert copy.default == f.default and copy.metadata["help"] is None  # no help of its own...
        assert flag_help[f.name].startswith(docs[f.name].replace("%", "%%"))  # ...the flag's is the owner's docstring
        assert copy.metadata["choices"] is f.metadata.get("choices")  # the same tuple: one declaration
        assert copy.repr == f.repr
    # ...and EngineArgs builds each config with those defaults
    made = {CacheConfig: EngineArgs().cache_config(), SchedulerConfig: EngineArgs().scheduler_config(),
            ParallelConfig: EngineArgs().parallel_config(), RequestLimits: EngineArgs().request_limits()}
    assert made[config_cls] == config_cls()


@pytest.mark.parametrize("config_cls", [*RUNTIME_CONFIGS, config.SpeculativeConfig, ServerConfig], ids=lambda c: c.__name__)
def test_configs_are_frozen_with_a_docstring_per_field(config_cls):
    assert config_cls.__dataclass_params__.frozen
    docs = field_docs(config_cls)
    assert all(docs.get(f.name) for f in dataclasses.fields(config_cls)), set(f.name for f in dataclasses.fields(config_cls)) - set(docs)


def test_max_model_len_has_one_default_the_models_context_capped_at_4096():
    assert SchedulerConfig().max_model_len is None and EngineArgs().max_model_len is None
    assert SchedulerConfig().for_model(8192).max_model_len == 4096
    assert EngineArgs().scheduler_config(2048).max_model_len == 2048
    assert EngineArgs(max_model_len=1024).scheduler_config(8192).max_model_len == 1024
    with pytest.raises(ValueError, match=r"max_model_len=5000 exceeds the model's context length \(4096\)"):
        EngineArgs(max_model_len=5000).scheduler_config(4096)
    with pytest.raises(ValueError, match="max_model_len must be >= 2, got 1"):
        EngineArgs(max_model_len=1)  # refused when configured, before any model loads


def test_step_budget_default_depends_on_device_and_runner_and_a_given_value_wins():
    assert EngineArgs().max_num_batched_tokens is None
    assert EngineArgs().scheduler_config(4096).max_num_batched_tokens == 512
    assert EngineArgs().scheduler_config(4096, "cuda").max_num_batched_tokens == 2048
    assert EngineArgs(runner="pooling").scheduler_config(4096).max_num_batched_tokens == 2048
    assert EngineArgs(max_num_batched_tokens=4096).scheduler_config(4096).max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):
        EngineArgs(max_num_batched_tokens=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(preemption_mode="lru"), "preemption_mode must be one of recompute, swap, got 'lru'"),
    (dict(scheduling_policy="lifo"), "scheduling_policy must be one of fcfs, priority, got 'lifo'"),
    (dict(routing="random"), "routing must be one of least-loaded, prefix-affinity, got 'random'"),
    (dict(distributed_executor_backend="slurm"), "distributed_executor_backend must be one of mp, ray"),
    (dict(dtype="fp8"), "dtype must be one of auto, float32, float16, bfloat16, bf16-matmul, got 'fp8'"),
    (dict(attention_backend="flash"), "attention_backend must be one of auto, torch, cpu, triton"),
    (dict(block_size=0), "block_size must be >= 1, got 0"),
    (dict(kv_cache_memory="0GiB"), "kv_cache_memory must be > 0 bytes"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory: cannot read a memory size from 'lots'"),
    (dict(swap_space=-1), "swap_space must be >= 0 bytes"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(ray_max_restarts=-1), "ray_max_restarts must be >= 0, got -1"),
    (dict(routing_affinity_blocks=0), "routing_affinity_blocks must be >= 1, got 0"),
    (dict(routing_max_imbalance=-2), "routing_max_imbalance must be >= 0, got -2"),
    (dict(max_logprobs=21), "max_logprobs must be <= 20"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in"),
    (dict(num_threads=0), "num_threads must be >= 1"),
    (dict(device="tpu"), "device must be 'auto', 'cpu' or 'cuda'"),
    (dict(speculative_config={"method": "medusa"}), "speculative method must be one of"),
    (dict(batch_invariant=True, enable_lora=True), "batch_invariant does not cover LoRA adapters yet"),
])
def test_a_bad_setting_is_refused_when_configured_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_the_runtime_config_alone_refuses_the_same_values():
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap"):
        CacheConfig(preemption_mode="lru")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(scheduling_policy="lifo")


def test_the_flags_offer_the_choices_the_configs_accept(capsys):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    choices = {a.dest: a.choices for a in parser._actions if a.choices is not None}
    assert choices["preemption_mode"] is config.PREEMPTION_MODES
    assert choices["scheduling_policy"] is config.SCHEDULING_POLICIES
    assert choices["routing"] is config.ROUTINGS and choices["dtype"] is config.DTYPES
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "lru"])
    assert "invalid choice: 'lru'" in capsys.readouterr().err
    # The help of an owned field is its config's docstring, and its default is shown.
    help_text = " ".join(parser.format_help().split())
    assert ("How a preempted request gets its KV back: recompute it, or swap it out to host memory. "
            "(default: recompute)") in help_text


def test_field_docs_reads_the_string_under_each_field():
    @dataclasses.dataclass
    class Example:
        documented: int = 1
        """Spread over
        two lines."""
        undocumented: int = 2

    assert field_docs(Example) == {"documented": "Spread over two lines."}


def test_no_config_module_passes_450_lines():
    for path in (Path(config.__file__).parent).glob("*.py"):
        assert len(path.read_text().splitlines()) <= 450, path.name


def test_bfloat16_on_a_cpu_without_amx_is_warned_about(monkeypatch, caplog):
    """--dtype bfloat16 is fast only where oneDNN multiplies on AMX tiles; elsewhere the engine says so."""
    import logging

    import torch

    from pagedllm.model.layers import greedy_head
    from pagedllm.worker.gpu import resolve_dtype

    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.gpu"):
        assert resolve_dtype("float32", cpu) == torch.float32 and not caplog.records
        monkeypatch.setattr(greedy_head, "cpu_has_fast_bf16", lambda: False)  # the CPU's flags, as an AVX2 CPU has
        assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert "without AMX-BF16" in caplog.text
