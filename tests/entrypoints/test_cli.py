"""The command line: engine and server flags are generated from their dataclass fields, so each default
is declared once; every flag spelling users type keeps working."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from pagedllm.config import EngineArgs, add_flags, flag, parse_memory_size
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import ServerConfig, configs_from_args


def _serve(*argv: str) -> tuple[EngineArgs, ServerConfig]:
    return configs_from_args(build_parser().parse_args(["--log-level", "WARNING", "serve", *argv]))


def test_no_flags_give_the_dataclass_defaults(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    engine_args, server_config = _serve()
    assert engine_args == EngineArgs()
    assert server_config == ServerConfig(log_level="WARNING")
    generate = build_parser().parse_args(["generate", "hi"])
    assert EngineArgs.from_cli_args(generate) == EngineArgs()


def test_every_scalar_engine_field_is_a_flag():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    defaults = vars(parser.parse_args([]))
    for f in dataclasses.fields(EngineArgs):
        if isinstance(f.default, (bool, int, float, str)):
            assert defaults.get(f.name, "missing") == f.default, f"EngineArgs.{f.name}: no flag, or another default"


def test_existing_spellings_parse_to_the_same_values(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    engine_args, server = _serve(
        "/models/m", "-tp", "2", "--no-prefix-caching", "--kv-cache-memory", "2GiB", "--swap-space", "512MiB",
        "--enforce-eager", "--num-kv-blocks", "64", "--max-model-len", "1024", "--dtype", "bfloat16",
        "--api-key", "a", "--api-key", "b", "--served-model-name", "x", "--max-request-body-bytes", "4KiB",
        "--share-prefix-cache-across-keys", "--port", "9000")
    assert (engine_args.model, engine_args.tensor_parallel_size, engine_args.enable_prefix_caching) == ("/models/m", 2, False)
    assert (engine_args.kv_cache_memory, engine_args.swap_space) == (2 * 2**30, 512 * 2**20)
    assert (engine_args.enforce_eager, engine_args.num_kv_blocks, engine_args.max_model_len) == (True, 64, 1024)
    assert engine_args.dtype == "bfloat16"
    assert server == ServerConfig(port=9000, api_keys=("a", "b"), served_model_names=("x",),
                                  share_prefix_cache_across_keys=True, max_request_body_bytes=4096,
                                  log_level="WARNING")
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["generate", "hi", "--tensor-parallel-size", "4", "--enforce-eager", "false"])).tensor_parallel_size == 4


def test_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    assert _serve()[1].api_keys == ("from-env",)
    assert _serve("--api-key", "given")[1].api_keys == ("given",)


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: cannot read a memory size from 'lots'"),
    (["--enforce-eager", "maybe"], "argument --enforce-eager: expected true or false, got 'maybe'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["-tp", "two"], "argument --tensor-parallel-size/-tp: invalid int value: 'two'"),
])
def test_a_bad_value_is_a_usage_error_naming_its_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "hi", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_prints(command, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp" in out and "(default: 1GiB)" in out


@dataclass
class _Settings:
    """A stand-in for a dataclass another change grows: the flags follow its fields with no CLI edit."""

    threads: Optional[int] = None
    mode: Literal["fast", "exact"] = "exact"
    budget: int = flag(3 << 20, "Memory, 100% of it.", parse=parse_memory_size, aliases=("-b",))
    verbose: bool = flag(False, "Talk more.", group="output")
    hook: Callable | None = None
    internal: str = dataclasses.field(default="x", metadata={"cli": False})


def test_flags_follow_whatever_fields_exist(capsys):
    parser = argparse.ArgumentParser(prog="t")
    add_flags(parser, _Settings)
    args = parser.parse_args(["--threads", "4", "--mode", "fast", "-b", "1MiB", "--verbose"])
    assert vars(args) == {"threads": 4, "mode": "fast", "budget": 2**20, "verbose": True}
    assert vars(parser.parse_args([])) == {"threads": None, "mode": "exact", "budget": 3 << 20, "verbose": False}
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "slow"])
    parser.print_help()  # a % in a help string must not break --help
    out = capsys.readouterr().out
    assert "Memory, 100% of it. (default: 3MiB)" in out and "output:" in out
    assert "--hook" not in out and "--internal" not in out


def test_hardening_flags(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    _, server = _serve("--allowed-origins", "https://a.example,https://b.example", "--allowed-origins",
                       "http://localhost:3000", "--max-num-waiting", "0", "--request-timeout", "30",
                       "--shutdown-timeout", "5", "--keep-alive-on-engine-death", "--timeout-request-header", "2",
                       "--h11-max-incomplete-event-size", "32KiB", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem")
    assert server.allowed_origins == ("https://a.example", "https://b.example", "http://localhost:3000")
    assert (server.max_num_waiting, server.request_timeout, server.shutdown_timeout) == (0, 30.0, 5.0)
    assert server.keep_alive_on_engine_death and server.h11_max_incomplete_event_size == 32 * 1024
    assert (server.ssl_keyfile, server.ssl_certfile) == ("k.pem", "c.pem")
    defaults = ServerConfig()
    assert defaults.allowed_origins == () and defaults.shutdown_timeout == 30.0 and defaults.max_num_waiting > 0
