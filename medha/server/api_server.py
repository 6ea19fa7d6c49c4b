"""OpenAI-compatible HTTP API over the engine (FastAPI; served by uvicorn from `medha serve`)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from medha import __version__
from medha.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
    is_fatal,
)
from medha.engine.llm_engine import LLMEngine, RequestOutput
from medha.engine.sampling_params import SamplingParams
from medha.server.async_engine import AsyncEngine, QueueFullError, is_final
from medha.server.body_guard import BodyGuard
from medha.server.config import ServerConfig
from medha.server.errors import RequestError, SafeJSONResponse, from_validation
from medha.server.metrics import ServerMetrics
from medha.server.openapi import document
from medha.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("medha.server")


def max_request_bytes(config: ServerConfig, max_model_len: int) -> int:
    """The body limit: the flag, else room for a context of tokens written the longest way
    JSON allows (a long token, escaped) plus the rest of a request."""
    if config.max_request_bytes is not None:
        return config.max_request_bytes
    return 64 * max_model_len + (1 << 20)


class _Choice:
    """One prompt of a request, as the engine sees it."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int],
                 prompt_text: str | None) -> None:
        self.index, self.request_id = index, request_id
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text
        self.queue: asyncio.Queue | None = None
        self.final: RequestOutput | None = None
        self.logprobs: list = []


def build_app(engine: LLMEngine, config: ServerConfig | None = None,
              engine_thread: bool = True) -> FastAPI:
    """The API over `engine`. With `engine_thread` the app starts the engine loop on a thread
    of its own; without, the caller runs `app.state.engine.run()` on the thread it chooses."""
    config = config or ServerConfig()
    model_name = config.served_model_name or engine.config.model
    metrics = ServerMetrics(engine.scheduler.blocks.num_blocks)
    aengine = AsyncEngine(engine, metrics, config.max_waiting)
    tokenizer = engine.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            aengine.start()
        yield
        aengine.stop()

    app = FastAPI(title="medha", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the medha engine. Per-request service "
                  "targets go in a `medha` object: priority, ttft_slo_s, tpot_slo_s.")
    app.state.engine = aengine
    body_limit = max_request_bytes(config, engine.scheduler.max_model_len)
    app.add_middleware(BodyGuard, max_bytes=body_limit)
    app.openapi = lambda: app.openapi_schema or document(app, config.api_key is not None)

    # ---- errors: always OpenAI's shape -------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        if e.status < 500 and e.status != 429:
            metrics.requests.labels("invalid").inc()
        return e.response(headers={"Retry-After": "1"} if e.status in (429, 503) else None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        metrics.requests.labels("invalid").inc()
        return from_validation(list(e.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code,
                                                                          "invalid_request_error")
        return RequestError(str(e.detail), None, e.status_code, kind).response(
            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # a bug: say so, keep serving
        log.exception("unhandled error")
        metrics.requests.labels("failed").inc()
        return RequestError(f"internal error: {type(e).__name__}", None, 500,
                            "server_error").response()

    api_key = config.api_key

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise StarletteHTTPException(401, "invalid or missing API key "
                                         "(Authorization: Bearer KEY)")

    # ---- plain endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if aengine.dead:
            return SafeJSONResponse({"status": "error", "reason": aengine.dead},
                                    status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "medha",
            "max_model_len": engine.scheduler.max_model_len}]}

    # ---- generation --------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise RequestError(f"model {name!r} is not served here; this server serves "
                               f"{model_name!r}", "model", 404, "not_found_error",
                               "model_not_found")

    def sampling(body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens or 16, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k, seed=body.seed, stop=body.stops,
                stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
                logprobs=logprobs)
        except InvalidRequestError as e:
            param = "top_logprobs" if e.param == "logprobs" and \
                isinstance(body, ChatCompletionRequest) else e.param
            raise RequestError(str(e), param) from None

    def slo(body) -> dict:
        m = body.medha
        if m is None:
            return {}
        return {"ttft_deadline_s": m.ttft_slo_s, "tpot_target_s": m.tpot_slo_s,
                "priority_class": m.priority}

    async def submit(choices: list[_Choice], params: list[SamplingParams], body) -> None:
        """Admit every choice or none."""
        try:
            for c, p in zip(choices, params):
                c.queue = await aengine.add(c.request_id, c.prompt_ids, p, **slo(body))
        except BaseException as e:
            for c in choices:
                if c.queue is not None:
                    aengine.abort(c.request_id)
            if isinstance(e, QueueFullError):
                metrics.requests.labels("rejected").inc()
                raise RequestError(f"server busy: {e}; retry later", None, 429,
                                   "rate_limit_error") from None
            if isinstance(e, EngineDeadError):
                metrics.requests.labels("failed").inc()
                raise RequestError(f"engine unavailable: {e}", None, 503,
                                   "service_unavailable") from None
            if isinstance(e, InvalidRequestError):
                raise RequestError(str(e), e.param) from None
            if isinstance(e, ValueError):  # the scheduler's: context or KV capacity
                msg = str(e)
                param = "max_tokens" if "max_tokens" in msg else "prompt"
                raise RequestError(msg, param) from None
            if isinstance(e, Exception) and not is_fatal(e):  # a bug, this request's alone
                log.exception("admission failed")
                raise RequestError(f"internal error admitting the request: "
                                   f"{type(e).__name__}", None, 500, "server_error") from None
            raise

    def default_max_tokens(prompt_len: int) -> int:
        room = min(engine.scheduler.max_model_len, engine.scheduler.blocks.capacity_tokens)
        return max(1, room - prompt_len)

    async def encode_prompts(body: CompletionRequest) -> list[_Choice]:
        prompts = body.prompts
        if len(prompts) > config.max_waiting:  # could never be admitted at once
            raise RequestError(f"{len(prompts)} prompts in one request; at most "
                               f"{config.max_waiting} (--max-waiting)", "prompt")
        choices = []
        base = f"cmpl-{uuid.uuid4().hex}"
        for i, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                ids = await run_in_threadpool(engine_call, engine.encode_prompt, p, param)
                text = p
            else:
                ids, text = list(p), None
            if not ids:
                raise RequestError("prompt encodes to no tokens", param)
            choices.append(_Choice(i, f"{base}-{i}", ids, text))
        return choices

    def engine_call(fn, *args):
        """Tokenizing for the engine, on a worker thread: its refusals are 400s."""
        try:
            return fn(*args)
        except InvalidRequestError as e:
            raise RequestError(str(e), e.param) from None

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        choices = await encode_prompts(body)
        params = [sampling(body, body.max_tokens, body.logprobs) for _ in choices]
        await submit(choices, params, body)
        rid = choices[0].request_id.rsplit("-", 1)[0]
        if body.stream:
            return _sse(stream_completion(rid, choices, body), choices, aengine)
        if not await collect(choices, request):
            return Response(status_code=499)  # nobody is listening any more
        return completion_body(rid, choices, body)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await run_in_threadpool(engine_call, engine.encode_chat, messages)
        choice = _Choice(0, f"chatcmpl-{uuid.uuid4().hex}", ids, None)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, body.max_new_tokens or default_max_tokens(len(ids)), logprobs)
        await submit([choice], [params], body)
        if body.stream:
            return _sse(stream_chat(choice, body), [choice], aengine)
        if not await collect([choice], request):
            return Response(status_code=499)
        return chat_body(choice, body)

    async def collect(choices: list[_Choice], request: Request) -> bool:
        """Wait for every choice to finish; False (and all aborted) if the client went away."""
        async def drain(c: _Choice) -> None:
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
        except EngineDeadError as e:
            raise RequestError(f"engine failed during the request: {e}", None, 503,
                               "service_unavailable") from None
        except RequestFailedError as e:
            raise RequestError(str(e), None, 500, "server_error") from None
        finally:
            watch.cancel()
            for c in choices:
                if c.final is None or not c.final.finished:
                    aengine.abort(c.request_id)

    # ---- response bodies ---------------------------------------------------------------------
    def usage(choices: list[_Choice]) -> dict:
        prompt = sum(len(c.prompt_ids) for c in choices)
        completion = sum(len(c.final.token_ids) if c.final else 0 for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def completion_logprobs(samples: list, offset: int) -> dict:
        tokens, text_offset = [], []
        for s in samples:
            tokens.append(tokenizer.decode([s.token], skip_special_tokens=False))
            text_offset.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [s.logprob for s in samples],
                "top_logprobs": [{tokenizer.decode([t], skip_special_tokens=False): lp
                                  for t, lp in s.top_logprobs} for s in samples],
                "text_offset": text_offset}

    def chat_logprobs(samples: list) -> dict:
        def entry(token: int, lp: float) -> dict:
            text = tokenizer.decode([token], skip_special_tokens=False)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {"content": [entry(s.token, s.logprob) | {
            "top_logprobs": [entry(t, lp) for t, lp in s.top_logprobs]} for s in samples]}

    def completion_body(rid: str, choices: list[_Choice], body: CompletionRequest) -> dict:
        out = []
        for c in choices:
            prefix = (c.prompt_text if c.prompt_text is not None
                      else tokenizer.decode(c.prompt_ids)) if body.echo else ""
            out.append({"index": c.index, "text": prefix + c.final.text,
                        "logprobs": completion_logprobs(c.logprobs, len(prefix))
                        if body.logprobs is not None else None,
                        "finish_reason": c.final.finish_reason})
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": out, "usage": usage(choices)}

    def chat_body(c: _Choice, body: ChatCompletionRequest) -> dict:
        return {"id": c.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": c.final.text},
                    "logprobs": chat_logprobs(c.logprobs) if body.logprobs else None,
                    "finish_reason": c.final.finish_reason}],
                "usage": usage([c])}

    async def merged(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        """Outputs of several choices as they come."""
        tasks = {asyncio.ensure_future(c.queue.get()): c for c in choices}
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    c = tasks.pop(t)
                    item = t.result()
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        continue
                    c.final = item
                    yield c, item
                    tasks[asyncio.ensure_future(c.queue.get())] = c
        finally:
            for t in tasks:
                t.cancel()

    def include_usage(body) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    async def stream_completion(rid: str, choices: list[_Choice], body: CompletionRequest):
        def chunk(choice: dict) -> dict:
            return {"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": model_name, "choices": [choice]} | (
                {"usage": None} if include_usage(body) else {})
        offsets = {}
        if body.echo:
            for c in choices:
                text = c.prompt_text if c.prompt_text is not None else \
                    tokenizer.decode(c.prompt_ids)
                offsets[c.index] = len(text)
                yield chunk({"index": c.index, "text": text, "logprobs": None,
                             "finish_reason": None})
        async for c, out in merged(choices):
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(out.logprobs or [], offsets.get(c.index, 0))
                offsets[c.index] = offsets.get(c.index, 0) + len(out.delta_text)
            if out.delta_text or out.finished or lp:
                yield chunk({"index": c.index, "text": out.delta_text, "logprobs": lp,
                             "finish_reason": out.finish_reason})
        if include_usage(body):
            yield {"id": rid, "object": "text_completion", "created": int(time.time()),
                   "model": model_name, "choices": [], "usage": usage(choices)}

    async def stream_chat(c: _Choice, body: ChatCompletionRequest):
        def chunk(delta: dict, finish: str | None, lp=None) -> dict:
            return {"id": c.request_id, "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                 "finish_reason": finish}]} | (
                {"usage": None} if include_usage(body) else {})
        yield chunk({"role": "assistant", "content": ""}, None)
        async for _, out in merged([c]):
            lp = chat_logprobs(out.logprobs or []) if body.logprobs else None
            if out.delta_text or out.finished or lp:
                yield chunk({"content": out.delta_text} if out.delta_text else {},
                            out.finish_reason, lp)
        if include_usage(body):
            yield {"id": c.request_id, "object": "chat.completion.chunk",
                   "created": int(time.time()), "model": model_name, "choices": [],
                   "usage": usage([c])}

    return app


def _sse(events: AsyncIterator[dict], choices: list[_Choice], aengine: AsyncEngine
         ) -> StreamingResponse:
    """Server-sent events ending in [DONE]. A client that disconnects cancels the generator,
    and the `finally` frees the requests' KV."""
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        except (EngineDeadError, RequestFailedError) as e:
            # the stream has started (status 200): the error goes in an event of its own
            error = RequestError(f"engine failed during the request: {e}", None, 503,
                                 "service_unavailable") if isinstance(e, EngineDeadError) \
                else RequestError(str(e), None, 500, "server_error")
            yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for c in choices:
                if c.final is None or not c.final.finished:
                    aengine.abort(c.request_id)
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
