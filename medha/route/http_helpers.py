"""HTTP helpers of the router: ASGI answers (raw bytes, JSON, an OpenAI-style error), a request
body read whole, a replica's URL as the router keeps it, and what is read of a replica's answer
(the headers passed on; whether a held stream carries a token yet)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from medha.server.errors import RequestError

if TYPE_CHECKING:
    import aiohttp

    from medha.route.backend import Backend


def base_url(url: str) -> str:
    """A replica's URL as the router keeps it: no trailing slash, no /v1."""
    return url.rstrip("/").removesuffix("/v1")


def unauthorized() -> RequestError:
    return RequestError(
        "invalid or missing API key (Authorization: Bearer KEY)", None, 401, "authentication_error"
    )


_OWN_HEADERS = (b"x-medha-replica", b"x-medha-predicted-ttft-ms")
_MAX_PASSED_HEADERS = 16


def replica_headers(b: Backend, response: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    """`x-medha-replica` and the replica's own `x-` response headers (request ids, its
    engine's facts), up to 16, each up to 1 KiB; the router's own names are the router's."""
    headers = [(b"x-medha-replica", str(b.replica_id).encode())]
    for name, value in response.headers.items():
        key = name.lower().encode("latin-1", "replace")
        if not key.startswith(b"x-") or key in _OWN_HEADERS or len(value) > 1024:
            continue
        try:
            headers.append((key, value.encode("latin-1")))
        except UnicodeEncodeError:
            continue
        if len(headers) > _MAX_PASSED_HEADERS:
            break
    return headers


def has_token(held: bytearray) -> bool:
    """Whether the SSE events held so far carry a token (text, a content delta, or an end)."""
    for event in bytes(held).split(b"\n\n")[:-1]:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            try:
                obj = json.loads(data)
            except ValueError:
                return True  # not ours to judge: pass it on
            if not isinstance(obj, dict) or "error" in obj:
                return True
            for choice in obj.get("choices") or ():
                if not isinstance(choice, dict):
                    return True
                delta = choice.get("delta")
                if choice.get("text") or choice.get("finish_reason"):
                    return True
                if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
                    return True
    return False


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def error_body(message: str, code: int) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ).encode()


async def send_raw(
    send,
    status: int,
    body: bytes,
    content_type: bytes | None = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    out = list(headers or [])
    if content_type is not None:
        out.append((b"content-type", content_type))
    elif not any(k.lower() == b"content-type" for k, _ in out):
        out.append((b"content-type", b"application/json"))
    out.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, obj) -> None:
    await send_raw(send, status, json.dumps(obj, ensure_ascii=True, allow_nan=False).encode())


async def send_error(send, error: RequestError, retry_after: bool = False) -> None:
    headers = [(b"retry-after", b"1")] if retry_after else []
    body = json.dumps(error.body(), ensure_ascii=True).encode()
    await send_raw(send, error.status, body, b"application/json", headers)
