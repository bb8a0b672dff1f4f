"""vLLM's spellings of the server flags, parsed by the real `pagedllm` parser: several values after one flag,
JSON forms, human-readable lengths, inline chat templates, the tool-calling pair and --generation-config."""

from __future__ import annotations

import json

import pytest

from pagedllm.config import parse_token_count
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import LoRAModule, configs_from_args, load_chat_template


def _serve(*argv: str):
    return configs_from_args(build_parser().parse_args(["serve", *argv]))


def test_lora_modules_several_after_one_flag_and_json(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    as_json = json.dumps({"name": "a3", "path": "/adapters/three", "base_model_name": "base"})
    engine_args, server = _serve("/models/m", "--enable-lora", "--lora-modules", "a1=/adapters/one",
                                 "a2=/adapters/two", as_json, "--lora-modules", "a4=/adapters/four")
    assert engine_args.model == "/models/m"  # not taken for a2=... as it once was
    assert server.lora_modules == (LoRAModule("a1", "/adapters/one"), LoRAModule("a2", "/adapters/two"),
                                   LoRAModule("a3", "/adapters/three", "base"), LoRAModule("a4", "/adapters/four"))


@pytest.mark.parametrize("spec, needle", [
    ("a1", "takes name=path or a JSON object"),
    ("=/x", "takes name=path or a JSON object"),
    ('{"name": "a1"', "cannot read"),
    ('{"name": "a1"}', "needs string fields name and path"),
    ('{"name": "a1", "path": "/x", "rank": 8}', "needs string fields name and path"),
    ('{"name": "a1", "path": "/x", "base_model_name": 3}', "needs string fields name and path"),
])
def test_bad_lora_modules_are_named(spec, needle):
    with pytest.raises(ValueError, match=needle):
        _serve("--lora-modules", spec)


def test_several_names_keys_and_origins_after_one_flag(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    _, server = _serve("--served-model-name", "first", "second", "--api-key", "k1", "k2", "--api-key", "k3",
                       "--allowed-origins", '["https://a.example", "https://b.example"]')
    assert server.served_model_names == ("first", "second")
    assert server.api_keys == ("k1", "k2", "k3")
    assert server.allowed_origins == ("https://a.example", "https://b.example")
    _, repeated = _serve("--served-model-name", "first", "--served-model-name", "second",
                         "--allowed-origins", "https://a.example,https://b.example")
    assert (repeated.served_model_names, repeated.allowed_origins) == (server.served_model_names,
                                                                      server.allowed_origins)


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("32k", 32000), ("25.6k", 25600), ("1K", 1024),
                                          ("32K", 32768), ("1m", 1_000_000)])
def test_max_model_len_reads_vllms_suffixes(text, tokens):
    assert parse_token_count(text) == tokens
    engine_args, _ = _serve("--max-model-len", text)
    assert engine_args.max_model_len == tokens


@pytest.mark.parametrize("text", ["1.5K", "12.5", "lots", "-3"])
def test_bad_max_model_len_is_refused(text, capsys):
    with pytest.raises(SystemExit):
        _serve("--max-model-len", text)
    assert "--max-model-len" in capsys.readouterr().err


def test_chat_template_from_a_file_or_inline(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert _serve("--chat-template", str(path))[1].chat_template == template
    assert _serve("--chat-template", template)[1].chat_template == template
    escaped = template.replace("\n", "\\n")  # a shell's single-line form
    assert load_chat_template(escaped) == template
    with pytest.raises(ValueError, match="looks like a file path"):
        _serve("--chat-template", str(tmp_path / "missing.jinja"))


def test_tool_calling_pair_and_generation_config():
    engine_args, server = _serve("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                 "--generation-config", "vllm")
    assert (server.enable_auto_tool_choice, server.tool_call_parser) == (True, "llama3_json")
    assert engine_args.generation_config == "vllm"
    with pytest.raises(SystemExit):  # a parser vLLM has and we do not: argparse names the choices
        _serve("--tool-call-parser", "granite")


def test_an_adapters_base_model_name_must_be_served():
    from pagedllm.entrypoints.openai.serving_lora import LoRARegistry
    from pagedllm.lora.request import LoRAError

    registry = LoRARegistry(lambda request: None)
    registry.add("a1", "/adapters/one", ["first", "second"], "second")
    registry.add("a2", "/adapters/two", ["first", "second"])
    assert registry.parents == {"a1": "second", "a2": "first"}  # what /v1/models reports as the parent
    with pytest.raises(LoRAError, match="base_model_name 'other'"):
        registry.add("a3", "/adapters/three", ["first", "second"], "other")
