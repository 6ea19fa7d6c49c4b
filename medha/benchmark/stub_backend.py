"""A stub OpenAI-compatible backend that answers at once: the replica behind `medha route` when
the router's own cost is measured (bench/route/route_overhead.py), and a replica that fails on
demand in the router's tests.

    python -m medha.benchmark.stub_backend --port 8100 [--model stub] [--n-tokens 1]
        [--delay-s 0] [--token-delay-s 0] [--status 503] [--hang]
        [--die-after-tokens K] [--exit-after-tokens K]

Torch-free, and as cheap per request as Python gets on a 2-core machine, so that what a
benchmark measures through it is the router and not the backend: a raw ASGI app (no FastAPI,
no pydantic: their per-request cost is several times this app's) under uvicorn with uvloop and
httptools, no access log. aiohttp's web server, measured beside it on the 2-core machine of
issue 33 at 500 req/s, took about 315 us of CPU a request against this app's 210-240 us.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(non-streamed, or `"stream": true`: OpenAI's event stream ending in `data: [DONE]`), and the
stub's own `GET /stub/stats` (requests served), `GET`/`POST /stub/config` (the fault knobs).

Fault knobs (flags at start-up; changed at run time by `POST /stub/config` with a JSON object of
the knobs to change, so a test flips them without a restart; `{"reset_stats": true}` zeroes the
counters). They apply to the two generation routes only, so /health keeps answering, as a
replica whose engine is wedged but whose HTTP server is alive does:

- `delay_s`: sleep before the first byte of the answer;
- `token_delay_s`: sleep between streamed tokens;
- `status`: answer with this HTTP status and an OpenAI error body (500, 503, 429, ...);
- `hang`: accept the request and never answer (until the client goes away);
- `die_after_tokens`: stream that many tokens, then drop the connection without `[DONE]` (a
  non-streamed request gets its headers and half its body, then the drop): a replica whose
  connection breaks, the process living on;
- `exit_after_tokens`: the same, but the process exits at once (`os._exit`), as under kill -9.

`stub_backend(**knobs)` runs it in a subprocess on a free port for a test or a benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_dumps = json.JSONEncoder(separators=(",", ":")).encode


@dataclasses.dataclass
class Knobs:
    """What the stub answers and how it fails; every field is a flag and a /stub/config key."""

    model: str = "stub"
    n_tokens: int = 1  # completion tokens per answer, whatever max_tokens asks for
    delay_s: float = 0.0
    token_delay_s: float = 0.0
    status: int = 0  # 0: answer normally
    hang: bool = False
    die_after_tokens: int | None = None
    exit_after_tokens: int | None = None
    max_model_len: int | None = None  # reported in /v1/models when set (as medha serve does)
    # a batch-time model's description (JSON, medha/perf/published.py), served at
    # GET /medha/predictor when set (as medha serve publishes its own)
    predictor: str = ""

    def update(self, changes: dict) -> None:
        """Apply a /stub/config body; a wrong key or type raises ValueError (the caller's 400)
        rather than leaving a knob the test did not mean to set."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        for key, value in changes.items():
            if key not in fields:
                raise ValueError(f"unknown knob {key!r}; knobs: {sorted(fields)}")
            default = getattr(Knobs, key)
            kind = type(default) if default is not None else int
            ok = value is None if default is None else False
            ok = ok or (type(value) is kind) or (kind is float and type(value) is int)
            if not ok:
                raise ValueError(f"{key} takes a {kind.__name__}, got {value!r}")
        for key, value in changes.items():
            setattr(self, key, float(value) if type(getattr(Knobs, key)) is float else value)


def _request_id(rid: str) -> tuple[bytes, bytes]:
    """The answer's id as a response header, as servers send theirs (a router passes its
    replica's `x-` headers on)."""
    return (b"x-request-id", rid.encode())


class _Drop(Exception):
    """Raised after a response has started, so uvicorn closes the connection mid-answer."""


class _QuietDrops(logging.Filter):
    """uvicorn logs every exception out of an app with its traceback; a deliberate drop is not
    news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Drop))


def _prompt_tokens(body: dict) -> int:
    """About four characters a token: a stub has no tokenizer, and the router only needs a
    plausible number in `usage`."""
    if "messages" in body:
        chars = 0
        messages = body.get("messages")
        for msg in messages if isinstance(messages, list) else ():
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(
                    len(p["text"])
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
        return max(1, chars // 4)
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return len(prompt)
        return sum(len(p) if isinstance(p, list) else max(1, len(str(p)) // 4) for p in prompt)
    return 1


def _error(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_exceeded"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class StubApp:
    """The ASGI app. One instance per process; its knobs are mutable at run time."""

    def __init__(self, knobs: Knobs | None = None):
        self.knobs = knobs or Knobs()
        self.requests = 0
        self.created = int(time.time())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return  # uvicorn runs it with lifespan off; websockets are not served
        path, method = scope["path"], scope["method"]
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                return await self._json(send, 405, _error(405, "method not allowed"))
            return await self._generate(path == "/v1/chat/completions", receive, send)
        if path == "/health":
            return await self._json(send, 200, {"status": "ok"})
        if path == "/v1/models":
            model = {"id": self.knobs.model, "object": "model", "created": self.created}
            model["owned_by"] = "medha-stub"
            if self.knobs.max_model_len is not None:
                model["max_model_len"] = self.knobs.max_model_len
            return await self._json(send, 200, {"object": "list", "data": [model]})
        if path == "/medha/predictor" and self.knobs.predictor:
            body = self.knobs.predictor.encode()
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            return await send({"type": "http.response.body", "body": body})
        if path == "/stub/stats":
            return await self._json(send, 200, {"requests": self.requests})
        if path == "/stub/config":
            if method == "POST":
                try:
                    changes = json.loads(await _body(receive))
                    if not isinstance(changes, dict):
                        raise ValueError("the body must be a JSON object")
                    if changes.pop("reset_stats", False):
                        self.requests = 0
                    self.knobs.update(changes)
                except ValueError as exc:
                    return await self._json(send, 400, _error(400, str(exc)))
            return await self._json(send, 200, dataclasses.asdict(self.knobs))
        return await self._json(send, 404, _error(404, f"no route {path}"))

    @staticmethod
    async def _json(send, status: int, obj: dict) -> None:
        body = _dumps(obj).encode()
        headers = [*_JSON, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _generate(self, chat: bool, receive, send) -> None:
        raw = await _body(receive)
        self.requests += 1
        k = self.knobs
        if k.hang:
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        if k.delay_s > 0:
            await asyncio.sleep(k.delay_s)
        if k.status:
            return await self._json(send, k.status, _error(k.status, "stub: injected failure"))
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return await self._json(send, 400, _error(400, "the body is not a JSON object"))
        prompt_tokens = _prompt_tokens(body)
        n = k.n_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        rid = f"{'chatcmpl' if chat else 'cmpl'}-stub-{self.requests}"
        head = {"id": rid, "object": "", "created": int(time.time()), "model": k.model}
        die = k.exit_after_tokens if k.exit_after_tokens is not None else k.die_after_tokens
        if body.get("stream") is True:
            return await self._stream(chat, head, n, usage, body, die, send)
        text = " tok" * n
        if chat:
            head["object"] = "chat.completion"
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            head["object"] = "text_completion"
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason="length")
        out = _dumps({**head, "choices": [choice], "usage": usage}).encode()
        headers = [*_JSON, (b"content-length", str(len(out)).encode()), _request_id(rid)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if die is not None:
            await send(
                {"type": "http.response.body", "body": out[: len(out) // 2], "more_body": True}
            )
            await self._die()
        await send({"type": "http.response.body", "body": out})

    async def _stream(self, chat, head, n, usage, body, die, send) -> None:
        k = self.knobs
        headers = [*_SSE, _request_id(head["id"])]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        head["object"] = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict | None, **extra) -> dict:
            base = {**head, "choices": [choice] if choice else [], **extra}
            return {
                "type": "http.response.body",
                "body": b"data: " + _dumps(base).encode() + b"\n\n",
                "more_body": True,
            }

        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            await send(event({**role, "logprobs": None, "finish_reason": None}))
        for i in range(n):
            if die is not None and i >= die:
                await self._die()
            if i and k.token_delay_s > 0:
                await asyncio.sleep(k.token_delay_s)
            delta = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
            last = i == n - 1
            choice = {"index": 0, **delta, "logprobs": None}
            choice["finish_reason"] = "length" if last and not chat else None
            await send(event(choice))
        if die is not None:
            await self._die()
        if chat:
            await send(
                event({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"})
            )
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            await send(event(None, usage=usage))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def _die(self) -> None:
        if self.knobs.exit_after_tokens is not None:
            await asyncio.sleep(0)  # let the event loop hand what was sent to the socket
            os._exit(1)
        raise _Drop


async def _body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


def _knob_flags(knobs: Knobs) -> list[str]:
    """The command-line flags that start a stub with these knobs (the inverse of main's)."""
    flags = []
    for f in dataclasses.fields(knobs):
        value, default = getattr(knobs, f.name), f.default
        if value == default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if type(default) is bool:
            flags.append(flag)
        else:
            flags += [flag, str(value)]
    return flags


@contextmanager
def stub_backend(
    port: int | None = None, with_process: bool = False, cpu: int | None = None, **knobs
) -> Iterator:
    """Run a stub in a subprocess (on `port`, or a free one), wait for its /health, yield its
    base URL (with `with_process`, the pair (URL, Popen), for a test that kills it); stopped on
    the way out. `knobs`: `Knobs` fields. `cpu`: pin it to this core (taskset), for a benchmark
    that keeps the stub off the router's core."""
    from medha.benchmark.local_server import local_server

    flags = _knob_flags(Knobs(**knobs))
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []

    def command(p: int) -> list[str]:
        # The file, not `-m medha...`: it imports nothing of medha, so the stub starts from
        # any working directory and whichever medha the interpreter would find.
        return [*pin, sys.executable, os.path.abspath(__file__), "--port", str(p), *flags]

    with local_server(command, quiet=True, startup_s=30, with_process=with_process, port=port) as u:
        yield u


def serve(host: str, port: int, knobs: Knobs) -> None:
    import uvicorn

    logging.getLogger("uvicorn.error").addFilter(_QuietDrops())
    config = uvicorn.Config(
        StubApp(knobs),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        # A hung request would otherwise hold SIGTERM's graceful shutdown forever.
        timeout_graceful_shutdown=1,
    )
    uvicorn.Server(config).run()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    defaults = Knobs()
    for f in dataclasses.fields(Knobs):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if type(default) is bool:
            ap.add_argument(flag, action="store_true")
        else:
            kind = type(default) if default is not None else int
            ap.add_argument(flag, type=kind, default=getattr(defaults, f.name))
    args = ap.parse_args(argv)
    knobs = Knobs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Knobs)})
    serve(args.host, args.port, knobs)


if __name__ == "__main__":
    main()
