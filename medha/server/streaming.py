"""Server-sent events of the generation routes: `data: {chunk}` lines, an error event if the
request fails mid-stream, then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from medha.engine.errors import EngineDeadError, RequestFailedError
from medha.engine.outputs import RequestOutput
from medha.server.generation import Body, Choice, abort_unfinished, failure
from medha.server.state import AsyncEngineLike


def sse(
    events: AsyncIterator[dict], choices: list[Choice], async_engine: AsyncEngineLike
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
            yield f"data: {json.dumps(failure(e).body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            abort_unfinished(async_engine, choices)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
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


def include_usage(body: Body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
