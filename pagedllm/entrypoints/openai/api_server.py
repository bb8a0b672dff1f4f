"""The OpenAI-compatible server: FastAPI routes over an AsyncLLM whose core runs in its own process.

    python -m pagedllm.entrypoints.openai.api_server [MODEL] [--port 8000] ...   (or `pagedllm serve`)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.anthropic.serving_messages import add_messages_routes
from pagedllm.entrypoints.openai.auth import APIKeyMiddleware
from pagedllm.entrypoints.openai.cli_args import ServerConfig, add_serve_args, configs_from_args
from pagedllm.entrypoints.openai.serving import ServingContext, now_s
from pagedllm.entrypoints.openai.errors import APIError, api_error_from
from pagedllm.entrypoints.openai.http_intake import (
    DrainMiddleware,
    RequestIdMiddleware,
    h11_protocol_with_header_timeout,
    read_model,
)
from pagedllm.entrypoints.openai.lifecycle import Lifecycle, PagedLLMServer, replica_health
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_chat import apply_chat_template, create_chat_completion
from pagedllm.entrypoints.openai.serving_completion import create_completion
from pagedllm.entrypoints.openai.serving_responses import add_responses_routes
from pagedllm.entrypoints.openai.serving_embedding import add_embedding_routes
from pagedllm.entrypoints.openai.serving_score import add_score_routes
from pagedllm.entrypoints.openai.tools import ToolPlan
from pagedllm.entrypoints.openai.serving_lora import LoRARegistry, add_lora_routes
from pagedllm.errors import EngineDeadError, PagedLLMError
from pagedllm.metrics import ServerMetrics
from pagedllm.metrics.prometheus import PROMETHEUS_CONTENT_TYPE
from pagedllm.version import __version__

logger = logging.getLogger(__name__)


def build_app(ctx: ServingContext, config: ServerConfig, metrics: ServerMetrics,
              lifecycle: Lifecycle | None = None) -> FastAPI:
    """The FastAPI app: routes, OpenAI-style error bodies, auth, CORS, request ids, draining."""
    app = FastAPI(title="pagedllm", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    engine = ctx.engine

    async def body(raw_request: Request, model_cls):
        return await read_model(raw_request, model_cls, config.max_request_body_bytes, config.timeout_request_body,
                                engine.run_blocking)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(PagedLLMError)
    async def _engine_error(_: Request, exc: PagedLLMError):
        return api_error_from(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return APIError(exc.status_code, message).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return APIError(400, str(exc.errors()[0].get("msg", exc))).response()

    def require_engine() -> None:
        if engine.is_dead:
            raise APIError(503, "the engine is not available; it stopped", code="engine_dead")

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        require_engine()
        request = await body(raw_request, CompletionRequest)
        return await create_completion(request, raw_request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request):
        require_engine()
        request = await body(raw_request, ChatCompletionRequest)
        return await create_chat_completion(request, raw_request, ctx)

    add_responses_routes(app, ctx, body, require_engine)  # OpenAI's Responses API (Codex CLI)
    add_messages_routes(app, ctx, body, require_engine)  # Anthropic's Messages API (Claude Code)
    add_embedding_routes(app, ctx, body, require_engine)
    add_score_routes(app, ctx, body, require_engine)

    @app.get("/v1/models")
    async def models():
        # "root" is the served name, never the local path the model was loaded from; "sampling_defaults" is what a
        # request that leaves those fields unset runs with (--generation-config)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now_s(), "owned_by": "pagedllm", "root": name,
             "max_model_len": engine.max_model_len, "sampling_defaults": engine.generation_defaults}
            for name in ctx.served_model_names
        ] + [  # LoRA adapters: "parent" is the base model
            {"id": name, "object": "model", "created": now_s(), "owned_by": "pagedllm", "root": name,
             "parent": ctx.loras.parents[name], "max_model_len": engine.max_model_len}
            for name in (ctx.loras.adapters if ctx.loras is not None else ())
        ]}

    if ctx.loras is not None and config.allow_runtime_lora_updating:
        add_lora_routes(app, ctx.loras, ctx.served_model_names, body)

    @app.get("/health")
    async def health():
        try:
            await engine.check_health()
        except EngineDeadError:
            return APIError(503, "unhealthy: the engine core is not running", code="engine_dead").response()
        replicas = replica_health(engine)
        if replicas is not None:  # data parallel: degraded (200) while some replica is down
            return JSONResponse(replicas[1], status_code=replicas[0])
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(raw_request: Request):
        request = await body(raw_request, TokenizeRequest)
        ctx.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'")
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")

        def run() -> JSONResponse:
            if request.messages is not None:
                plan = ToolPlan(config.tool_call_parser, request.tools, request.tools, None) if request.tools else None
                tokens = apply_chat_template(engine.tokenizer, request.messages, request.add_generation_prompt, plan)
            else:
                tokens = engine.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            return JSONResponse({"tokens": list(tokens), "count": len(tokens), "max_model_len": engine.max_model_len})

        return await engine.run_blocking(run)

    @app.post("/detokenize")
    async def detokenize(raw_request: Request):
        request = await body(raw_request, DetokenizeRequest)
        ctx.check_model(request.model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")

        def run() -> JSONResponse:
            engine.check_token_ids(request.tokens, "tokens")
            return JSONResponse({"prompt": engine.tokenizer.decode(request.tokens)})

        return await engine.run_blocking(run)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    if config.enable_dashboard:
        from pagedllm.entrypoints.openai.dashboard import add_dashboard_routes

        add_dashboard_routes(app, ctx.engine, metrics, config.api_keys, lifecycle)

    # Outermost last: request id, then draining, then CORS (its preflights need no key), then auth (with keys).
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    if lifecycle is not None:
        app.add_middleware(DrainMiddleware, lifecycle=lifecycle)
    app.add_middleware(RequestIdMiddleware)
    return app


def default_served_model_name(engine_args: EngineArgs) -> str:
    if engine_args.model is None:
        return "SmolLM2-135M-Instruct"
    return Path(engine_args.model).expanduser().name or engine_args.model


def lora_registry(engine_args: EngineArgs, config: ServerConfig, engine: AsyncLLM,
                  names: list[str]) -> LoRARegistry | None:
    """The served adapters (--lora-modules, each checked now: a LoRAError stops the server); None without
    --enable-lora."""
    if not engine_args.enable_lora:
        if config.lora_modules or config.allow_runtime_lora_updating:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        return None
    registry = LoRARegistry(engine.check_lora)
    for module in config.lora_modules:
        registry.add(module.name, module.path, names, module.base_model_name)
    return registry


def set_chat_template(tokenizer, template: str) -> None:
    """--chat-template: the template every chat request (and /tokenize) renders with, instead of the model's."""
    if tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    tokenizer.chat_template = template
    logger.info("chat template from --chat-template (%d characters) replaces the model's", len(template))


def _ignore_signal(signum, frame) -> None:
    logger.info("received signal %d; shutting down", signum)


async def run_server(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Start the engine core, serve HTTP until SIGINT/SIGTERM (draining first), then stop both.

    Returns the exit code: 0, or 1 when the engine core died (unless config.keep_alive_on_engine_death)."""
    names = list(config.served_model_names) or [default_served_model_name(engine_args)]
    metrics = ServerMetrics(names[0])
    engine = await AsyncLLM.start(engine_args, metrics, log_level=config.log_level,
                                  num_threads=config.num_frontend_threads)
    try:
        scheme = "https" if config.ssl_certfile else "http"
        logger.info("engine core ready (%d KV blocks, max_model_len %d); serving %s on %s://%s:%d",
                    engine.num_kv_blocks, engine.max_model_len, names, scheme, config.host, config.port)
        if (ready_msgs := getattr(engine.client, "ready_msgs", None)) is not None:
            logger.info("%d engine replicas, KV blocks %s (total %d)", len(ready_msgs),
                        [r.num_blocks for r in ready_msgs], engine.num_kv_blocks)
        if not config.api_keys:
            logger.warning("no API key set: /v1/*, /tokenize and /detokenize are open to anyone who can reach %s",
                           config.host)
        if config.chat_template is not None:
            set_chat_template(engine.tokenizer, config.chat_template)
        lifecycle = Lifecycle()
        loras = lora_registry(engine_args, config, engine, names)
        app = build_app(ServingContext(engine, names, config, metrics, loras), config, metrics, lifecycle)
        uvicorn_config = uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level.lower(), access_log=False,
            lifespan="off", http=h11_protocol_with_header_timeout(config.timeout_request_header),
            # the drain (PagedLLMServer) has already waited for requests; this only bounds the stragglers
            timeout_graceful_shutdown=5, timeout_keep_alive=config.timeout_keep_alive,
            h11_max_incomplete_event_size=config.h11_max_incomplete_event_size,
            limit_concurrency=config.limit_concurrency or None,
            ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile)
        server = PagedLLMServer(uvicorn_config, lifecycle, engine, config.shutdown_timeout,
                                config.keep_alive_on_engine_death)
        # PagedLLMServer turns SIGINT/SIGTERM into a drain; should a signal still reach the handler
        # installed before it (uvicorn re-raises the ones it captures), make that a no-op so the
        # engine shutdown below runs.
        previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            await server.serve()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        logger.info("shutting down the engine core")
        await engine.shutdown()
    return server.exit_code


def cmd_serve(args: argparse.Namespace) -> int:
    """The `serve` subcommand."""
    engine_args, config = configs_from_args(args)
    return asyncio.run(run_server(engine_args, config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server")
    parser.add_argument("--log-level", default="INFO")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return cmd_serve(args)
    except (ValueError, PagedLLMError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
