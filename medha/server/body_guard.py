"""What bytes may enter: an ASGI middleware in front of every route.

- **Size.** A body over `max_bytes` gets 413 before it is parsed: at once when its
  Content-Length says so (not a byte of it is read), else as soon as the bytes received pass the
  limit (chunked transfer). A 50 MB prompt used to be parsed and tokenized in full before the
  context check (52 s, 7 GB of memory kept).
- **All bodies at once.** Bodies are buffered whole before they are parsed, so many clients
  each sending a body just under the limit (slowly, or all at once) would hold their sum in
  memory. The bytes of all bodies being received are capped at `max_buffered_bytes`: a body
  whose bytes would pass it gets 429 with Retry-After, and its bytes are let go at once.
- **Text.** JSON can carry what no UTF-8 encoder accepts: lone surrogates (`"\\ud800"`) and,
  in the raw bytes, invalid UTF-8. Either gets a 400 naming the field that holds it, instead
  of a 500 from whatever meets it first (the tokenizer, the response encoder).

FastAPI >= 0.164 has a body limit of its own; this one also sees the bytes it buffers, which
the text check needs, and answers in OpenAI's error shape.
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from medha.server.errors import RequestError

# an escaped UTF-16 surrogate, \uD800-\uDFFF: only bodies holding one need a closer look
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyGuard:
    def __init__(
        self, app: ASGIApp, max_bytes: int, max_buffered_bytes: int, command: str = "medha serve"
    ) -> None:
        """`command`: the server whose flags set the limits, which a refusal names."""
        self.app, self.max_bytes, self.max_buffered_bytes = app, max_bytes, max_buffered_bytes
        self.command = command
        self.buffered = 0  # bytes of the bodies being received now, all connections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            return await self._refuse(scope, send, _too_large(length, self.max_bytes, self.command))
        if length is not None and self.buffered + length > self.max_buffered_bytes:
            return await self._refuse(scope, send, _busy(self.max_buffered_bytes, self.command))
        body, held = bytearray(), 0
        try:
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left before sending its body
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) + len(chunk) > self.max_bytes:
                    return await self._refuse(
                        scope, send, _too_large(None, self.max_bytes, self.command)
                    )
                if self.buffered + len(chunk) > self.max_buffered_bytes:
                    return await self._refuse(
                        scope, send, _busy(self.max_buffered_bytes, self.command)
                    )
                body += chunk
                self.buffered += len(chunk)
                held += len(chunk)
        finally:
            # the buffer goes with this frame; from here on the body is the route's to parse
            self.buffered -= held
        if (error := bad_text(bytes(body))) is not None:
            return await self._refuse(scope, send, error)
        await self.app(scope, _replay(bytes(body), receive), send)

    @staticmethod
    async def _refuse(scope: Scope, send: Send, error: RequestError) -> None:
        # the unread rest of a refused body is never read: the connection closes after this
        headers = {"Connection": "close"}
        if error.status == 429:
            headers["Retry-After"] = "1"
        response = error.response(headers=headers)
        await response(scope, _no_body, send)


def bad_text(body: bytes) -> RequestError | None:
    """A 400 naming the first field whose text is invalid UTF-8 or a lone surrogate; None for
    clean bodies (and for bodies that are not JSON: the route says so)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:  # invalid bytes become lone surrogates, found below
        text = body.decode("utf-8", "surrogateescape")
    else:
        if not _SURROGATE_ESCAPE.search(body):
            return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    path = _first_unencodable(value)
    if path is None:
        return None
    name = ".".join(path) or "body"
    return RequestError(
        f"{name} holds invalid UTF-8 or a lone surrogate (\\ud800-\\udfff), which is not text",
        name if path else None,
        code="invalid_value",
    )


def _first_unencodable(value) -> list[str] | None:
    """The path of the first string (or object key) that UTF-8 cannot encode, breadth first
    (an explicit queue: a body may nest deeper than Python's recursion limit)."""
    queue = [([], value)]
    for path, v in queue:
        if isinstance(v, str):
            if not _encodable(v):
                return path
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _encodable(k):
                    return [*path, k.encode("utf-8", "backslashreplace").decode()]
                queue.append(([*path, k], item))
        elif isinstance(v, list):
            queue.extend(([*path, str(i)], item) for i, item in enumerate(v))
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _too_large(length: int | None, limit: int, command: str) -> RequestError:
    size = f"of {length} bytes " if length is not None else ""
    return RequestError(
        f"the request body {size}exceeds the server's limit of {limit} bytes "
        f"({command} --max-request-bytes)",
        None,
        413,
        code="request_too_large",
    )


def _busy(limit: int, command: str) -> RequestError:
    return RequestError(
        f"the request bodies being received exceed the server's limit of {limit} bytes in all "
        f"({command} --max-buffered-bytes); retry later",
        None,
        429,
        "rate_limit_error",
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body once, then the connection's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}
