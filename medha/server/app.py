"""The OpenAI-compatible HTTP API over the engine (FastAPI; served by uvicorn from `medha
serve`): one app's wiring. The routes live by concern in routes.py, completions.py and
chat.py; what they share in state.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from medha import __version__
from medha.server import chat, completions, routes
from medha.server.arrivals import CountArrivals
from medha.server.async_engine import AsyncEngine
from medha.server.body_guard import BodyGuard
from medha.server.config import ServerConfig, max_buffered_bytes, max_request_bytes
from medha.server.errors import RequestError, from_validation
from medha.server.metrics import ServerMetrics
from medha.server.openapi import document
from medha.server.state import AsyncEngineLike, EngineLike, ServerState

log = logging.getLogger("medha.server")


def build_app(
    engine: EngineLike,
    config: ServerConfig | None = None,
    engine_thread: bool = True,
    async_engine_cls: Callable[[Any, ServerMetrics, int], AsyncEngineLike] = AsyncEngine,
) -> FastAPI:
    """The API over `engine`, which requests reach through `async_engine_cls(engine, metrics,
    max_waiting)`: medha's `AsyncEngine` over its `LLMEngine` (the default), or another
    engine's pair of faces (`medha.vllm_executor.serving`). With `engine_thread` the app calls
    the async engine's `start()` (medha's: its loop on a thread of its own); without, the
    caller runs `app.state.engine.run()` on the thread it chooses."""
    config = config or ServerConfig()
    metrics = ServerMetrics(engine.num_kv_blocks, engine.stats, engine.kv_capacity_tokens)
    async_engine = async_engine_cls(engine, metrics, config.max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(
        title="medha",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible API of the medha engine. Per-request service "
        "targets go in a `medha` object: priority, ttft_slo_s, tpot_slo_s.",
    )
    app.state.engine = async_engine
    app.state.server = ServerState(
        engine=engine,
        async_engine=async_engine,
        config=config,
        metrics=metrics,
        model_name=config.served_model_name or engine.config.model,
        created=int(time.time()),
    )
    app.add_middleware(
        BodyGuard,
        max_bytes=max_request_bytes(config, engine.max_model_len),
        max_buffered_bytes=max_buffered_bytes(config, engine.max_model_len),
    )
    if (arrivals := getattr(async_engine, "arrivals", None)) is not None:
        # outside the body guard: a request is on its way in from its headers on
        app.add_middleware(CountArrivals, arrivals=arrivals)
    app.openapi = lambda: app.openapi_schema or document(app, config.api_key is not None)
    for exc, handler in (
        (RequestError, _request_error),
        (RequestValidationError, _validation_error),
        (StarletteHTTPException, _http_error),
        (Exception, _unexpected),
    ):
        app.add_exception_handler(exc, handler)
    for module in (routes, completions, chat):  # this order is the OpenAPI document's
        app.include_router(module.router)
    return app


# ---- errors: always OpenAI's shape -----------------------------------------------------------
def _metrics(request: Request) -> ServerMetrics:
    return request.app.state.server.metrics


async def _request_error(request: Request, e: RequestError):
    if e.status < 500 and e.status != 429:
        _metrics(request).requests.labels("invalid").inc()
    return e.response(headers={"Retry-After": "1"} if e.status in (429, 503) else None)


async def _validation_error(request: Request, e: RequestValidationError):
    _metrics(request).requests.labels("invalid").inc()
    return from_validation(list(e.errors())).response()


async def _http_error(request: Request, e: StarletteHTTPException):
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        e.status_code, "invalid_request_error"
    )
    return RequestError(str(e.detail), None, e.status_code, kind).response(
        headers=getattr(e, "headers", None)
    )


async def _unexpected(request: Request, e: Exception):  # a bug: say so, keep serving
    log.exception("unhandled error")
    _metrics(request).requests.labels("failed").inc()
    return RequestError(f"internal error: {type(e).__name__}", None, 500, "server_error").response()
