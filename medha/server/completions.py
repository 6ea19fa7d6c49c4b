"""POST /v1/completions: prompts (text or token ids, one choice each) to completions, whole or
streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from medha.engine.tokenizer import Tokenizer
from medha.server.errors import RequestError
from medha.server.generation import (
    Choice,
    check_model,
    collect,
    engine_call,
    sampling,
    submit,
    usage,
)
from medha.server.protocol import CompletionRequest
from medha.server.state import ServerState, ServerStateDep, authorize
from medha.server.streaming import include_usage, merged, sse

router = APIRouter()


@router.post("/v1/completions", dependencies=[Depends(authorize)])
async def completions(body: CompletionRequest, request: Request, state: ServerStateDep):
    check_model(state, body.model)
    choices = await _encode_prompts(state, body)
    params = [sampling(body, body.max_tokens, body.logprobs) for _ in choices]
    await submit(state, request, choices, params, body)
    rid = choices[0].request_id.rsplit("-", 1)[0]
    if body.stream:
        return sse(_stream(state, rid, choices, body), choices, state.async_engine)
    if not await collect(state, choices, request):
        return Response(status_code=499)  # nobody is listening any more
    return _body(state, rid, choices, body)


async def _encode_prompts(state: ServerState, body: CompletionRequest) -> list[Choice]:
    prompts = body.prompts
    limit = state.config.max_waiting
    if len(prompts) > limit:  # could never be admitted at once
        raise RequestError(
            f"{len(prompts)} prompts in one request; at most {limit} (--max-waiting)", "prompt"
        )
    choices = []
    base = f"cmpl-{uuid.uuid4().hex}"
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(p, str):
            ids = await run_in_threadpool(engine_call, state.engine.encode_prompt, p, param)
            text = p
        else:
            ids, text = list(p), None
        if not ids:
            raise RequestError("prompt encodes to no tokens", param)
        choices.append(Choice(i, f"{base}-{i}", ids, text))
    return choices


def _echoed(tokenizer: Tokenizer, c: Choice) -> str:
    return c.prompt_text if c.prompt_text is not None else tokenizer.decode(c.prompt_ids)


def _logprobs(tokenizer: Tokenizer, samples: list, offset: int) -> dict:
    tokens, text_offset = [], []
    for s in samples:
        tokens.append(tokenizer.decode([s.token], skip_special_tokens=False))
        text_offset.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [s.logprob for s in samples],
        "top_logprobs": [
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in s.top_logprobs}
            for s in samples
        ],
        "text_offset": text_offset,
    }


def _body(state: ServerState, rid: str, choices: list[Choice], body: CompletionRequest) -> dict:
    out = []
    for c in choices:
        prefix = _echoed(state.tokenizer, c) if body.echo else ""
        out.append(
            {
                "index": c.index,
                "text": prefix + c.final.text,
                "logprobs": _logprobs(state.tokenizer, c.logprobs, len(prefix))
                if body.logprobs is not None
                else None,
                "finish_reason": c.final.finish_reason,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": out,
        "usage": usage(choices),
    }


async def _stream(
    state: ServerState, rid: str, choices: list[Choice], body: CompletionRequest
) -> AsyncIterator[dict]:
    def chunk(choice: dict) -> dict:
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [choice],
        } | ({"usage": None} if include_usage(body) else {})

    offsets = {}
    if body.echo:
        for c in choices:
            text = _echoed(state.tokenizer, c)
            offsets[c.index] = len(text)
            yield chunk({"index": c.index, "text": text, "logprobs": None, "finish_reason": None})
    async for c, out in merged(choices):
        lp = None
        if body.logprobs is not None:
            lp = _logprobs(state.tokenizer, out.logprobs or [], offsets.get(c.index, 0))
            offsets[c.index] = offsets.get(c.index, 0) + len(out.delta_text)
        if out.delta_text or out.finished or lp:
            yield chunk(
                {
                    "index": c.index,
                    "text": out.delta_text,
                    "logprobs": lp,
                    "finish_reason": out.finish_reason,
                }
            )
    if include_usage(body):
        yield {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [],
            "usage": usage(choices),
        }
