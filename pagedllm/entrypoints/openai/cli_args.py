"""Flags of `pagedllm serve` (kept light: no FastAPI import until the server starts)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from pagedllm.config import EngineArgs, add_flags, flag, parse_memory_size


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's settings; the scalar fields become flags of `serve` (see config.add_flags)."""

    host: str = flag("127.0.0.1", "Address to listen on.")
    port: int = flag(8000, "Port to listen on.")
    api_keys: tuple[str, ...] = ()
    """Bearer tokens accepted on /v1/*; empty = no auth (flag: --api-key, repeatable)."""
    served_model_names: tuple[str, ...] = ()
    """Names clients may use for the model; empty = derived from the model path (flag: --served-model-name)."""
    share_prefix_cache_across_keys: bool = flag(False, "Let requests of different API keys share cached prefixes "
                                                       "(default: tenants are isolated).")
    max_request_body_bytes: int = flag(8 * 2**20, "Larger request bodies get 413, e.g. 8MiB.", parse=parse_memory_size)
    log_level: str = dataclasses.field(default="INFO", metadata={"cli": False})
    """Set by the top-level --log-level."""

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
    add_flags(serve, ServerConfig)
    serve.add_argument("--api-key", dest="api_keys", action="append", default=None,
                       help="accept this bearer token on /v1/* (repeatable; default $PAGEDLLM_API_KEY, else no auth)")
    serve.add_argument("--served-model-name", dest="served_model_names", action="append", default=None,
                       help="a name clients use for the model (repeatable; the first is reported)")
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
    flagged = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    server_config = ServerConfig(**{**flagged, "api_keys": tuple(api_keys),
                                    "served_model_names": tuple(args.served_model_names or ())})
    return EngineArgs.from_cli_args(args), server_config
