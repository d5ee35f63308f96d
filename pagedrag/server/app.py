"""The FastAPI app: OpenAI routes, /health, /metrics (the engine's Prometheus registry),
/v1/stats (the engine's counters as JSON, behind the API key like every /v1 route) and
/v1/warm (pagedrag.server.warm)."""

from __future__ import annotations

import contextlib
import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedrag import __version__
from pagedrag.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError
from pagedrag.server import legacy, tokenize, warm
from pagedrag.server.auth import ApiKeyMiddleware
from pagedrag.server.body_limit import BodySizeLimitMiddleware
from pagedrag.server.chat import create_chat_completion
from pagedrag.server.completions import create_completion
from pagedrag.server.errors import engine_dead, install_error_handlers
from pagedrag.server.openapi import EVENT_STREAM, error_responses, install_openapi
from pagedrag.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pagedrag.server.serving import ServerConfig, Serving


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """An app serving ``engine``; the caller owns the engine (and shuts it down).

    Invariant: only ``app.state`` holds the engine; the routes reach it through the request.
    FastAPI keeps every route function it has seen in module-level caches for the life of
    the process, so a route that closed over the engine would keep it (and its KV pool)
    alive after the app is gone."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.serving.templates.close()  # the request-template worker, if one was started

    app = FastAPI(title="pagedrag", version=__version__, lifespan=lifespan)
    app.state.serving = Serving(engine, config)
    install_error_handlers(app)
    install_openapi(app, api_keys=bool(config.api_keys))
    if config.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=config.api_keys)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_bytes)
    started = int(time.time())

    @app.get("/health", responses=error_responses(503))
    async def health(http_request: Request) -> Response:
        engine = _serving(http_request).engine
        if engine.dead_reason is not None:
            raise engine_dead(engine.dead_reason)
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics(http_request: Request) -> Response:
        return Response(generate_latest(_serving(http_request).engine.metrics_registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats", responses=error_responses(503))
    async def stats(http_request: Request) -> Response:
        """pagedrag's own route (not OpenAI's): what ``pagedrag.LLM.stats()`` returns."""
        try:
            return JSONResponse(await _serving(http_request).engine.stats())
        except EngineDeadError as error:
            raise engine_dead(str(error)) from error

    @app.get("/v1/models")
    async def models(http_request: Request) -> ModelList:
        max_model_len = _serving(http_request).max_model_len
        return ModelList(data=[ModelCard(id=name, created=started, max_model_len=max_model_len)
                               for name in config.served_model_names])

    @app.post("/v1/completions", responses={**EVENT_STREAM, **error_responses(400, 404, 503)})
    async def completions(request: CompletionRequest, http_request: Request):
        return await create_completion(_serving(http_request), request, http_request)

    @app.post("/v1/chat/completions", responses={**EVENT_STREAM, **error_responses(400, 404, 503)})
    async def chat_completions(request: ChatCompletionRequest, http_request: Request):
        return await create_chat_completion(_serving(http_request), request, http_request)

    app.include_router(tokenize.router)
    app.include_router(legacy.router)
    app.include_router(warm.router)
    return app


def _serving(http_request: Request) -> Serving:
    return http_request.app.state.serving
