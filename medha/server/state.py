"""What every route of one app shares, kept on `app.state.server` and handed to the routes as a
dependency (the routes are module-level functions, so several apps can live in one process)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from medha.engine.llm_engine import LLMEngine
from medha.engine.tokenizer import Tokenizer
from medha.server.async_engine import AsyncEngine
from medha.server.config import ServerConfig
from medha.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: LLMEngine  # facts and tokenizing only: its loop belongs to async_engine's thread
    async_engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics
    model_name: str  # the id clients send and /v1/models lists
    created: int  # when the server started (/v1/models' `created`)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer


async def server_state(request: Request) -> ServerState:
    # async: FastAPI would run a plain function on a worker thread, for every request
    return request.app.state.server


# a route's parameter of this type receives its app's ServerState (and adds nothing to the
# OpenAPI document)
ServerStateDep = Annotated[ServerState, Depends(server_state)]


async def authorize(request: Request) -> None:
    """The /v1 routes' dependency: the bearer key, when the server has one."""
    api_key = request.app.state.server.config.api_key
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise StarletteHTTPException(401, "invalid or missing API key (Authorization: Bearer KEY)")
