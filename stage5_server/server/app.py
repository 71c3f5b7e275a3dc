"""``create_app``: the FastAPI app, its middleware, and which routes it has.

    HTTP -> APIKeyMiddleware (401 unless a valid key; sets the trust group; auth.py)
         -> BodySizeLimitMiddleware (413; limits.py) -> route: decoded, parsed and checked (body.py, 400),
            parse strictly (protocol.py, 400)
         -> completions.py | chat.py | responses.py | models.py (lora_models.py) | pooling.py, cohere_embed.py
            -> serving.py -> the AsyncEngine
            (with --enable-dev-routes: dev_routes.py, weight updates and sleep)
         -> JSON, or SSE ``data: {...}`` chunks ending in ``data: [DONE]`` (sse.py)

The server's options are one ``ServerConfig`` (config.py); errors are OpenAI error objects (errors.py);
``/metrics`` (metrics.py); the schema (openapi.py).

vLLM: ``build_app`` and ``init_app_state`` in ``vllm/entrypoints/openai/api_server.py``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import replace
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from stage5_server.engine.frontend import AsyncEngine
from stage5_server.engine.thread_client import AsyncLLM
from stage5_server.server import chat, cohere_embed, completions, lora_models, models, pooling, responses
from stage5_server.server.auth import APIKeyMiddleware, APIKeys, CacheSalter
from stage5_server.server.body import CheckedRoute
from stage5_server.server.config import ServerConfig
from stage5_server.server.errors import APIError, install_error_handlers
from stage5_server.server.limits import BodySizeLimitMiddleware
from stage5_server.server.metrics import PrometheusStatLogger
from stage5_server.server.openapi import openapi_with_openai_errors
from stage5_server.server.serving import OpenAIServing

logger = logging.getLogger("stagedserve")


def version() -> str:
    try:
        return metadata.version("stagedserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def create_app(engine: AsyncEngine | Any, config: ServerConfig | None = None, **fields: Any) -> FastAPI:
    """The OpenAI-compatible app over an ``AsyncEngine`` or an ``LLM`` (wrapped, and shut down with the app).
    ``config``: the server's options (``config.py``), or its fields as keywords, e.g. ``api_keys={key: trust
    group}`` or a list of keys (None: no authentication, loopback only), ``limits`` (what one request may ask
    for, ``limits.py``), ``media`` (where images may come from, ``media.py``), ``lora_modules`` (``(name,
    path)`` of each LoRA adapter served from the start, ``lora_models.py``). A keyword given with ``config``
    replaces that field of it."""
    if config is None:
        config = ServerConfig(**fields)
    elif fields:
        config = replace(config, **fields)
    owns_engine = not isinstance(engine, AsyncEngine)
    if owns_engine:
        engine = AsyncLLM.from_llm(engine, log_stats_interval=config.log_stats_interval)
    keys = APIKeys(config.api_keys) if config.api_keys is not None else None
    model_name = config.served_model_name or engine.model_path
    metrics = PrometheusStatLogger(model_name, lambda: engine.stats_by_engine, engine.max_model_len,
                                   engine.cache_configs)
    engine.stat_loggers.append(metrics)
    serving = OpenAIServing(engine, model_name, CacheSalter(config.cache_salt_secret), config.trust_client_cache_salt,
                            version(), metrics, config.chat_options, config.limits, config.media)
    serving.models.num_groups = len(keys.groups) if keys is not None else 1
    for name, path in config.lora_modules:  # a bad adapter stops the start, with the 400's reason
        try:
            serving.models.load(name, path)
        except APIError as exc:
            raise ValueError(f"lora_modules: {name}={path}: {exc.message}") from None
    public_paths = frozenset({"/health"} | ({"/metrics"} if config.metrics_public else set()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await serving.models.send_unsent()  # the start-up adapters' weights, to the workers
        yield
        if metrics in engine.stat_loggers:
            engine.stat_loggers.remove(metrics)
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="stagedserve", version=version(), lifespan=lifespan,
                  description="An OpenAI-compatible server over the stagedserve engine.")
    app.router.route_class = CheckedRoute  # every JSON body: decoded, parsed (off the loop if large), checked
    app.state.engine = engine
    app.state.server_config = config
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.api_keys = keys
    app.state.public_paths = public_paths
    # Added last = outermost: authentication runs before anything else looks at the request.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(APIKeyMiddleware, keys=keys, public_paths=public_paths)
    install_error_handlers(app)

    @app.get("/health", summary="Liveness: 200 while the engine core runs (no API key needed)")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(APIError(503, "The engine is not running.", code="engine_unavailable").body(),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    models.add_routes(app, serving)
    lora_models.add_routes(app, serving.models)  # load/unload, with --enable-lora and the runtime switch
    completions.add_routes(app, serving)
    chat.add_routes(app, serving)
    responses.add_routes(app, serving)
    pooling.add_routes(app, serving)  # embeddings, pooling, score, rerank
    cohere_embed.add_routes(app, serving)  # Cohere's /v2/embed
    if config.enable_dev_routes:  # off: 404, and not in the schema
        from stage5_server.server.dev_routes import add_dev_routes

        add_dev_routes(app, engine)

    @app.get("/metrics", summary="Prometheus metrics (needs an API key unless metrics_public)")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: openapi_with_openai_errors(app, needs_key=keys is not None)
    return app
