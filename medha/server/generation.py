"""What the completion and chat routes share: a request's choices, their sampling parameters,
admitting them all or none, waiting for them, and the usage they report."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from medha.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
    is_fatal,
)
from medha.engine.outputs import RequestOutput
from medha.engine.sampling_params import SamplingParams
from medha.server.arrivals import end_arrival
from medha.server.async_engine import QueueFullError, is_final
from medha.server.errors import RequestError
from medha.server.protocol import ChatCompletionRequest, CompletionRequest
from medha.server.state import AsyncEngineLike, OutputQueue, ServerState

log = logging.getLogger("medha.server")

T = TypeVar("T")
Body = CompletionRequest | ChatCompletionRequest


class Choice:
    """One prompt of a request, as the engine sees it."""

    def __init__(
        self, index: int, request_id: str, prompt_ids: list[int], prompt_text: str | None
    ) -> None:
        self.index, self.request_id = index, request_id
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text
        self.queue: OutputQueue | None = None
        self.final: RequestOutput | None = None  # the latest output
        self.logprobs: list = []


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise RequestError(
            f"model {name!r} is not served here; this server serves {state.model_name!r}",
            "model",
            404,
            "not_found_error",
            "model_not_found",
        )


def engine_call(fn: Callable[..., T], *args) -> T:
    """Tokenizing for the engine, on a worker thread: its refusals are 400s."""
    try:
        return fn(*args)
    except InvalidRequestError as e:
        raise RequestError(str(e), e.param) from None


def sampling(body: Body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens or 16,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stops,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except InvalidRequestError as e:
        param = (
            "top_logprobs"
            if e.param == "logprobs" and isinstance(body, ChatCompletionRequest)
            else e.param
        )
        raise RequestError(str(e), param) from None


def _slo(body: Body) -> dict:
    m = body.medha
    if m is None:
        return {}
    return {
        "ttft_deadline_s": m.ttft_slo_s,
        "tpot_target_s": m.tpot_slo_s,
        "priority_class": m.priority,
    }


async def submit(
    state: ServerState,
    request: Request,
    choices: list[Choice],
    params: list[SamplingParams],
    body: Body,
) -> None:
    """Admit every choice or none; either way the request is off the count of arrivals."""
    try:
        for c, p in zip(choices, params):
            c.queue = await state.async_engine.add(c.request_id, c.prompt_ids, p, **_slo(body))
    except BaseException as e:
        for c in choices:
            if c.queue is not None:
                state.async_engine.abort(c.request_id)
        error = _refusal(state, e)
        if error is None:
            raise
        raise error from None
    finally:
        end_arrival(request.scope)


def _refusal(state: ServerState, e: BaseException) -> RequestError | None:
    """The answer to a failed admission; None for an error that must go up as it is."""
    if isinstance(e, QueueFullError):
        state.metrics.requests.labels("rejected").inc()
        return RequestError(f"server busy: {e}; retry later", None, 429, "rate_limit_error")
    if isinstance(e, EngineDeadError):
        state.metrics.requests.labels("failed").inc()
        return RequestError(f"engine unavailable: {e}", None, 503, "service_unavailable")
    if isinstance(e, InvalidRequestError):
        return RequestError(str(e), e.param)
    if isinstance(e, ValueError):  # the scheduler's: context or KV capacity
        msg = str(e)
        return RequestError(msg, "max_tokens" if "max_tokens" in msg else "prompt")
    if isinstance(e, Exception) and not is_fatal(e):  # a bug, this request's alone
        log.exception("admission failed")
        return RequestError(
            f"internal error admitting the request: {type(e).__name__}", None, 500, "server_error"
        )
    return None


def failure(e: EngineDeadError | RequestFailedError) -> RequestError:
    """The answer to a request that failed after admission."""
    if isinstance(e, EngineDeadError):
        return RequestError(
            f"engine failed during the request: {e}", None, 503, "service_unavailable"
        )
    return RequestError(str(e), None, 500, "server_error")


def abort_unfinished(async_engine: AsyncEngineLike, choices: list[Choice]) -> None:
    """Free the KV of the choices nobody will read to the end."""
    for c in choices:
        if c.final is None or not c.final.finished:
            async_engine.abort(c.request_id)


async def collect(state: ServerState, choices: list[Choice], request: Request) -> bool:
    """Wait for every choice to finish; False (and all aborted) if the client went away."""

    async def drain(c: Choice) -> None:
        while not is_final(item := await c.queue.get()):
            c.final = item
            c.logprobs.extend(item.logprobs or [])
        if isinstance(item, BaseException):
            raise item

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.gather(*(drain(c) for c in choices))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left
            work.cancel()
            work.add_done_callback(lambda f: f.cancelled() or f.exception())
            return False
        work.result()
        return True
    except (EngineDeadError, RequestFailedError) as e:
        raise failure(e) from None
    finally:
        watch.cancel()
        abort_unfinished(state.async_engine, choices)


def usage(choices: list[Choice]) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt tokens
    the prefix cache supplied (0 with it off)."""
    prompt = sum(len(c.prompt_ids) for c in choices)
    completion = sum(len(c.final.token_ids) if c.final else 0 for c in choices)
    cached = sum(
        c.final.metrics["cached_prompt_tokens"] for c in choices if c.final and c.final.metrics
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
