"""What every route of one app shares, kept on `app.state.server` and handed to the routes as a
dependency (the routes are module-level functions, so several apps can live in one process)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from medha.engine.llm_engine import EngineStats
from medha.engine.sampling_params import SamplingParams
from medha.engine.tokenizer import Tokenizer
from medha.server.config import ServerConfig
from medha.server.metrics import ServerMetrics


class EngineLike(Protocol):
    """What the routes read from an engine: facts and tokenizing, never its loop. medha's
    `LLMEngine` is one; `medha.vllm_executor.serving.VllmEngine` is vLLM's."""

    config: Any  # its `model` names the served model
    tokenizer: Tokenizer

    @property
    def max_model_len(self) -> int: ...
    @property
    def kv_capacity_tokens(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    def encode_prompt(self, text: str, param: str = "prompt") -> list[int]: ...
    def encode_chat(self, messages: list[dict]) -> list[int]: ...
    def stats(self) -> EngineStats: ...


class OutputQueue(Protocol):
    """One request's RequestOutputs, then None, or the exception that ended it."""

    async def get(self) -> Any: ...


class AsyncEngineLike(Protocol):
    """How the routes run requests on an engine (`medha.server.async_engine.AsyncEngine` over
    medha's; `medha.vllm_executor.serving.VllmAsyncEngine` over vLLM's)."""

    @property
    def dead(self) -> str | None:
        """Why the engine stopped, once it has (503s and /health)."""

    async def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, **slo
    ) -> OutputQueue:
        """Admit a request, all or nothing; raises QueueFullError, EngineDeadError, or a
        ValueError for a request the engine refuses (InvalidRequestError names the field)."""

    def abort(self, request_id: str) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...


@dataclass
class ServerState:
    engine: EngineLike
    async_engine: AsyncEngineLike
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
