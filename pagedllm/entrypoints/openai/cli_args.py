"""Flags of `pagedllm serve` (kept light: no FastAPI import until the server starts)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

from pagedllm import envs
from pagedllm.config import EngineArgs, add_flags, flag, parse_memory_size


_TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
_REASONING_PARSERS = ("qwen3", "deepseek_r1")


class LoRAModule(NamedTuple):
    """One adapter of --lora-modules: `name=path`, or vLLM's JSON object."""

    name: str
    path: str
    base_model_name: str | None = None
    """The served model it adapts (vLLM's field; /v1/models reports it as the parent); None = the first name."""


def parse_lora_module(spec: str) -> LoRAModule:
    """vLLM's two forms: ``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``; ValueError naming
    the mistake."""
    if spec.lstrip().startswith("{"):
        try:
            fields = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"--lora-modules: cannot read {spec!r} as JSON: {e}") from None
        unknown = set(fields) - set(LoRAModule._fields) if isinstance(fields, dict) else set()
        if (not isinstance(fields, dict) or unknown
                or not all(isinstance(fields.get(k), str) and fields[k].strip() for k in ("name", "path"))
                or not isinstance(fields.get("base_model_name", ""), str)):
            raise ValueError(f"--lora-modules: a JSON adapter needs string fields name and path (and optionally "
                             f"base_model_name), got {spec!r}")
        return LoRAModule(fields["name"].strip(), fields["path"].strip(), fields.get("base_model_name"))
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes name=path or a JSON object, got {spec!r}")
    return LoRAModule(name.strip(), path.strip())


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's text, else (when it holds a brace or a newline) the template itself,
    with backslash escapes such as \\n decoded; ValueError for what looks like a path that cannot be read."""
    try:
        return Path(value).expanduser().read_text()
    except (OSError, ValueError):
        pass
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read")
    return value.encode("utf-8").decode("unicode_escape") if "\\" in value else value


def _json_list_or_text(values: list[str]) -> list[str]:
    """vLLM writes some list flags as JSON (--allowed-origins '["https://a"]'); read those, keep plain text."""
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except ValueError as e:
                raise ValueError(f"cannot read {value!r} as a JSON list: {e}") from None
            if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                raise ValueError(f"expected a JSON list of strings, got {value!r}")
            out.extend(items)
        else:
            out.append(value)
    return out


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's settings; the scalar fields become flags of `serve` (see config.add_flags)."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    api_keys: tuple[str, ...] = ()
    """Bearer tokens accepted on /v1/*; empty = no auth (flag: --api-key, repeatable)."""
    served_model_names: tuple[str, ...] = ()
    """Names clients may use for the model; empty = derived from the model path (flag: --served-model-name)."""
    share_prefix_cache_across_keys: bool = False
    """Let requests of different API keys share cached prefixes (default: tenants are isolated)."""
    max_request_body_bytes: int = flag(8 * 2**20, parse=parse_memory_size)
    """Larger request bodies get 413, e.g. 8MiB."""
    enable_prompt_tokens_details: bool = False
    """Report usage.prompt_tokens_details.cached_tokens even when it can tell one client what another sent (no
    API keys, or keys sharing the prefix cache)."""
    allowed_origins: tuple[str, ...] = ()
    """Origins browsers may call the API from (CORS); empty = none (flag: --allowed-origins, repeatable)."""
    max_num_waiting: int = flag(512, group="admission")
    """Most requests waiting to start (tokenizing or queued); beyond it new ones get 429 with Retry-After. 0 =
    unbounded."""
    retry_after_s: int = flag(1, group="admission")
    """The Retry-After (seconds) of a 429."""
    request_timeout: float = flag(0.0, group="admission")
    """Seconds after which an unfinished request is aborted and its client told why (504 / an error event). 0 =
    no deadline."""
    shutdown_timeout: float = flag(30.0, group="lifecycle")
    """On SIGTERM, seconds in-flight requests get to finish (new ones get 503) before the rest are ended with an
    error."""
    keep_alive_on_engine_death: bool = flag(False, group="lifecycle")
    """Keep answering 503 when the engine core dies, instead of exiting non-zero for a supervisor to restart."""
    enable_dashboard: bool = False
    """Serve the live KV block map at /dashboard (its event stream needs the API key when keys are set)."""
    num_frontend_threads: int = 4
    """Threads for tokenization, chat templates and big responses, so the event loop stays free."""
    timeout_keep_alive: float = flag(5.0, group="http")
    """Seconds an idle keep-alive connection is held open."""
    timeout_request_header: float = flag(10.0, group="http")
    """Seconds a connection may take to send a request's headers before it is closed."""
    timeout_request_body: float = flag(30.0, group="http")
    """Seconds a request body may stall between chunks before a 408."""
    h11_max_incomplete_event_size: int = flag(64 * 2**10, parse=parse_memory_size, group="http")
    """Largest request line + headers accepted, e.g. 64KiB."""
    limit_concurrency: int = flag(0, group="http")
    """Most concurrent connections and tasks before new ones get 503 (uvicorn's limit). 0 = unbounded."""
    ssl_keyfile: Optional[str] = flag(None, group="http")
    """TLS private key file (serve HTTPS with --ssl-certfile)."""
    ssl_certfile: Optional[str] = flag(None, group="http")
    """TLS certificate file."""
    tool_call_parser: str = flag("hermes", choices=_TOOL_PARSERS, group="tools")
    """The model family's tool-call format: how tools are prompted, parsed and constrained."""
    enable_auto_tool_choice: bool = flag(False, group="tools")
    """Allow tool_choice "auto" (the model decides whether to call a tool, parsed from its text)."""
    reasoning_parser: Optional[str] = flag(None, choices=_REASONING_PARSERS, group="tools")
    """Split <think>...</think> reasoning into message.reasoning_content."""
    trust_request_chat_template: bool = flag(False, group="chat templates")
    """Accept chat_template and chat_template_kwargs in chat requests (rendered in the same sandbox, under the same
    budget as the model's template); without it such a request is a 400."""
    responses_store_max_entries: int = flag(1000, group="Responses API")
    """Most responses the Responses API keeps for GET and previous_response_id (least recently used go first);
    0 = store none."""
    responses_store_max_bytes: int = flag(64 * 2**20, parse=parse_memory_size, group="Responses API")
    """Most bytes (as JSON) the stored responses may take, e.g. 64MiB; past it the least recently used go."""
    lora_modules: tuple[LoRAModule, ...] = ()
    """LoRA adapters served as models (flag: --lora-modules name=path or JSON, several; needs --enable-lora)."""
    chat_template: Optional[str] = dataclasses.field(default=None, metadata={"cli": False})
    """A chat template replacing the model's (flag: --chat-template, a file or the template inline)."""
    allow_runtime_lora_updating: bool = flag(False, group="LoRA adapters")
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key when keys are set)."""
    log_level: str = dataclasses.field(default="INFO", metadata={"cli": False})
    """Set by the top-level --log-level."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")
        for name in ("max_num_waiting", "limit_concurrency", "request_timeout", "retry_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        for name in ("shutdown_timeout", "timeout_keep_alive", "timeout_request_header", "timeout_request_body"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("responses_store_max_entries", "responses_store_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = store nothing), got {getattr(self, name)}")
        if self.num_frontend_threads < 1:
            raise ValueError(f"num_frontend_threads must be >= 1, got {self.num_frontend_threads}")
        if self.h11_max_incomplete_event_size < 1024:
            raise ValueError(f"h11_max_incomplete_event_size must be >= 1024, got {self.h11_max_incomplete_event_size}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("give both --ssl-keyfile and --ssl-certfile, or neither")
        if any(not origin for origin in self.allowed_origins):
            raise ValueError("an allowed origin must not be empty")
        for name, known in (("tool_call_parser", _TOOL_PARSERS), ("reasoning_parser", (None, *_REASONING_PARSERS))):
            if getattr(self, name) not in known:
                raise ValueError(f"{name} must be one of {', '.join(filter(None, known))}, got {getattr(self, name)!r}")


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """The flags of `serve`: the server's, then every engine arg."""
    serve.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                       help="HF model directory or .gguf file (same as --model)")
    add_flags(serve, ServerConfig)
    # vLLM's forms: several values after one flag, or the flag repeated (both add up)
    serve.add_argument("--api-key", dest="api_keys", action="extend", nargs="+", default=None, metavar="KEY",
                       help="accept these bearer tokens on /v1/* (several, or repeat the flag; default "
                            "$PAGEDLLM_API_KEY, else no auth)")
    serve.add_argument("--allowed-origins", dest="allowed_origins", action="extend", nargs="+", default=None,
                       help="origins browsers may call the API from, e.g. https://app.example (CORS; several, "
                            "comma-separated or a JSON list; default none)")
    serve.add_argument("--served-model-name", dest="served_model_names", action="extend", nargs="+", default=None,
                       metavar="NAME", help="names clients may use for the model (several; the first is reported)")
    serve.add_argument("--lora-modules", dest="lora_modules", action="extend", nargs="+", default=None,
                       metavar="NAME=PATH", help="PEFT LoRA adapters served as models: name=path, or JSON "
                                                 "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                                                 "(several; needs --enable-lora)")
    serve.add_argument("--chat-template", dest="chat_template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template replacing the model's: a file, or the template itself inline")
    EngineArgs.add_cli_args(serve)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            raise ValueError(f"two models given: {args.model_positional!r} and --model {args.model!r}")
        args.model = args.model_positional
    api_keys = args.api_keys
    if api_keys is None:
        env_key = envs.PAGEDLLM_API_KEY
        api_keys = [env_key] if env_key else []
    flagged = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    server_config = ServerConfig(**{**flagged, "api_keys": tuple(api_keys),
                                    "served_model_names": tuple(args.served_model_names or ()),
                                    "lora_modules": tuple(map(parse_lora_module, args.lora_modules or ())),
                                    "chat_template": chat_template,
                                    "allowed_origins": tuple(o.strip() for arg in
                                                             _json_list_or_text(args.allowed_origins or ())
                                                             for o in arg.split(","))})
    return EngineArgs.from_cli_args(args), server_config
