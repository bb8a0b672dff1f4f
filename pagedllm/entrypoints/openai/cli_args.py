"""Flags of `pagedllm serve` (kept light: no FastAPI import until the server starts)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pagedllm.config import EngineArgs, parse_memory_size

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    """Bearer tokens accepted on /v1/*; empty = no auth."""
    served_model_names: tuple[str, ...] = ()
    """Names clients may use for the model; empty = derived from the model path."""
    share_prefix_cache_across_keys: bool = False
    """Let requests of different API keys share cached prefixes (off: tenants are isolated)."""
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """The flags of `serve`: the server's, then every engine arg."""
    serve.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                       help="HF model directory or .gguf file (same as --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", dest="api_keys", action="append", default=None,
                       help="accept this bearer token on /v1/* (repeatable; default $PAGEDLLM_API_KEY, else no auth)")
    serve.add_argument("--served-model-name", dest="served_model_names", action="append", default=None,
                       help="a name clients use for the model (repeatable; the first is reported)")
    serve.add_argument("--share-prefix-cache-across-keys", action="store_true",
                       help="let different API keys share cached prefixes (default: isolated per key)")
    serve.add_argument("--max-request-body-bytes", default=str(DEFAULT_MAX_BODY_BYTES),
                       help="larger request bodies get 413 (e.g. 8MiB)")
    EngineArgs.add_cli_args(serve)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            raise ValueError(f"two models given: {args.model_positional!r} and --model {args.model!r}")
        args.model = args.model_positional
    api_keys = args.api_keys
    if api_keys is None:
        env_key = os.environ.get("PAGEDLLM_API_KEY")
        api_keys = [env_key] if env_key else []
    engine_args = EngineArgs.from_cli_args(args)
    server_config = ServerConfig(
        host=args.host, port=args.port, api_keys=tuple(api_keys),
        served_model_names=tuple(args.served_model_names or ()),
        share_prefix_cache_across_keys=args.share_prefix_cache_across_keys,
        max_request_body_bytes=parse_memory_size(args.max_request_body_bytes),
        log_level=getattr(args, "log_level", "INFO"),
    )
    return engine_args, server_config
