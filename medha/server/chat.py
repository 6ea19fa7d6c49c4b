"""POST /v1/chat/completions: messages through the model's chat template to one assistant
message, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from medha.engine.tokenizer import Tokenizer
from medha.server.generation import (
    Choice,
    check_model,
    collect,
    engine_call,
    sampling,
    submit,
    usage,
)
from medha.server.protocol import ChatCompletionRequest
from medha.server.state import ServerState, ServerStateDep, authorize
from medha.server.streaming import include_usage, merged, sse

router = APIRouter()


@router.post("/v1/chat/completions", dependencies=[Depends(authorize)])
async def chat(body: ChatCompletionRequest, request: Request, state: ServerStateDep):
    check_model(state, body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    ids = await run_in_threadpool(engine_call, state.engine.encode_chat, messages)
    choice = Choice(0, f"chatcmpl-{uuid.uuid4().hex}", ids, None)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_new_tokens or _room_after(state, len(ids))
    await submit(state, request, [choice], [sampling(body, max_tokens, logprobs)], body)
    if body.stream:
        return sse(_stream(state, choice, body), [choice], state.async_engine)
    if not await collect(state, [choice], request):
        return Response(status_code=499)  # nobody is listening any more
    return _body(state, choice, body)


def _room_after(state: ServerState, prompt_len: int) -> int:
    """The default max_tokens of a chat: the rest of the context (or of the KV cache)."""
    room = min(state.engine.max_model_len, state.engine.kv_capacity_tokens)
    return max(1, room - prompt_len)


def _logprobs(tokenizer: Tokenizer, samples: list) -> dict:
    def entry(token: int, lp: float) -> dict:
        text = tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            entry(s.token, s.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in s.top_logprobs]}
            for s in samples
        ]
    }


def _body(state: ServerState, c: Choice, body: ChatCompletionRequest) -> dict:
    return {
        "id": c.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": c.final.text},
                "logprobs": _logprobs(state.tokenizer, c.logprobs) if body.logprobs else None,
                "finish_reason": c.final.finish_reason,
            }
        ],
        "usage": usage([c]),
    }


async def _stream(
    state: ServerState, c: Choice, body: ChatCompletionRequest
) -> AsyncIterator[dict]:
    def chunk(delta: dict, finish: str | None, lp: dict | None = None) -> dict:
        return {
            "id": c.request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        } | ({"usage": None} if include_usage(body) else {})

    yield chunk({"role": "assistant", "content": ""}, None)
    async for _, out in merged([c]):
        lp = _logprobs(state.tokenizer, out.logprobs or []) if body.logprobs else None
        if out.delta_text or out.finished or lp:
            yield chunk(
                {"content": out.delta_text} if out.delta_text else {}, out.finish_reason, lp
            )
    if include_usage(body):
        yield {
            "id": c.request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [],
            "usage": usage([c]),
        }
