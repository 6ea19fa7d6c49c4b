"""Requests on their way in: received by the HTTP server, not yet handed to the engine.

A burst of requests reaches the engine one by one: the event loop parses and validates each
body in turn. An idle engine that starts a step the moment the first one is admitted makes the
rest wait out that step. On a 2-core Xeon, 8 prompts of 64 tokens sent at once ran as a 40 ms
step of one, then a step of 7: their median TTFT 0.20 s, against 0.12-0.15 s when one step
took all 8; which of the two a burst met (it depends on how the bodies interleave) moved the
convoy benchmark's time alone by up to 1.8x from one start of the server to the next.

So the HTTP server counts every generation request from the moment its headers are read until
its choices are all submitted or it fails (`CountArrivals`), and an engine with nothing running
waits for that count to reach zero before its first step, for at most a third of a chat's time
alone (medha/server/async_engine.py, `_gather`): the promise the pauses keep between layers,
that a request waits at most that share of its own time for the step it joins. A request alone
is off the count the moment it is submitted, so it waits for nobody.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

SCOPE_KEY = "medha.arrival"


class Arrival:
    """One request's place in the count, given back once (`end` may be called again)."""

    __slots__ = ("_arrivals", "_ended")

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self._ended = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._arrivals._end()


class Arrivals:
    """How many requests are on their way in: counted on the event loop, read by the engine's
    thread, which `on_end` wakes when one is in (or gone)."""

    def __init__(self, on_end: Callable[[], None] = lambda: None) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._on_end = on_end

    @property
    def pending(self) -> int:
        return self._count

    def begin(self) -> Arrival:
        with self._lock:
            self._count += 1
        return Arrival(self)

    def _end(self) -> None:
        with self._lock:
            self._count -= 1
        self._on_end()


def end_arrival(scope: Scope) -> None:
    """The request of `scope` is submitted (or refused): off the count."""
    arrival = scope.get(SCOPE_KEY)
    if arrival is not None:
        arrival.end()


class CountArrivals:
    """ASGI middleware: every POST to a generation route (/v1/completions, /v1/chat/completions)
    is on the count from its headers until the route submits it (`end_arrival`) or, whatever
    happens to it (a refused body, a validation error, a client gone), until it returns."""

    def __init__(self, app: ASGIApp, arrivals: Arrivals) -> None:
        self.app, self.arrivals = app, arrivals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].endswith("/completions")
        ):
            return await self.app(scope, receive, send)
        arrival = self.arrivals.begin()
        scope[SCOPE_KEY] = arrival
        try:
            await self.app(scope, receive, send)
        finally:
            arrival.end()
