"""A burst that reaches an idle engine starts in one step (medha/server/arrivals.py).

The engine loop runs on its own thread over a stand-in engine that records which requests
each step held; the HTTP side is played by calls to `Arrivals` and `AsyncEngine.add` on an
event loop, so that every order of arrival is chosen by the test, not by the machine's speed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from medha.engine.sampling_params import SamplingParams
from medha.server.arrivals import Arrivals, CountArrivals, end_arrival
from medha.server.async_engine import AsyncEngine


class _Predictor:
    def __init__(self, chat_s: float) -> None:
        self.chat_s = chat_s

    def prefill_step_time(self, num_tokens: int, kv_offset: int) -> float:
        return self.chat_s


class _Engine:
    """What AsyncEngine reads of an LLMEngine: requests finish in the step that runs them."""

    def __init__(self, chat_s: float) -> None:
        self.predictor = _Predictor(chat_s)
        self.max_model_len = 8192
        self.pauses = SimpleNamespace(arrivals=None, deliver=None)
        self.metrics = SimpleNamespace(iterations=0)
        self.waiting: list[str] = []
        self.steps: list[list[str]] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, **slo) -> None:
        self.waiting.append(request_id)

    def abort(self, request_id) -> bool:
        return False

    def step(self):
        self.steps.append(self.waiting)
        self.waiting = []
        self.metrics.iterations += 1
        return []


class _Metrics:
    iteration = SimpleNamespace(observe=lambda s: None)

    def __init__(self) -> None:
        self.requests = SimpleNamespace(labels=lambda kind: SimpleNamespace(inc=lambda: None))

    def finished(self, out) -> None:
        pass


@pytest.fixture
def loop():
    """The HTTP side's event loop, on a thread of its own as under uvicorn."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def _running(chat_s: float) -> tuple[AsyncEngine, _Engine]:
    engine = _Engine(chat_s)
    server = AsyncEngine(engine, _Metrics(), max_waiting=100)
    server.start()
    return server, engine


def _add(loop, server: AsyncEngine, rid: str) -> None:
    """A handler's submission: returns once the engine thread has admitted the request."""
    params = SamplingParams(max_tokens=1)
    asyncio.run_coroutine_threadsafe(server.add(rid, [1, 2, 3], params), loop).result(10)


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_burst_that_reaches_an_idle_engine_starts_in_one_step(loop):
    # (a chat takes 30 s alone here: the bound of 10 s never ends the wait in this test)
    server, engine = _running(chat_s=30.0)
    try:
        first, *rest = [server.arrivals.begin() for _ in range(3)]  # three bodies arriving
        _add(loop, server, "a")
        first.end()
        time.sleep(0.2)  # the other two still being received: no step yet
        assert engine.steps == []
        for rid, arrival in zip("bc", rest):
            _add(loop, server, rid)
            arrival.end()
        _wait_for(lambda: engine.steps)
        assert engine.steps == [["a", "b", "c"]]
    finally:
        server.stop()


def test_a_request_alone_waits_for_nobody(loop):
    server, engine = _running(chat_s=30.0)
    try:
        arrival = server.arrivals.begin()
        t0 = time.monotonic()
        _add(loop, server, "a")
        arrival.end()
        _wait_for(lambda: engine.steps)
        assert time.monotonic() - t0 < 5.0  # far below the 10 s bound
        assert engine.steps == [["a"]]
    finally:
        server.stop()


def test_a_body_that_never_comes_holds_the_first_step_only_a_third_of_a_chat(loop):
    server, engine = _running(chat_s=0.6)  # bound: 0.2 s
    try:
        server.arrivals.begin()  # a client that sends headers and never its body
        arrival = server.arrivals.begin()
        t0 = time.monotonic()
        _add(loop, server, "a")
        arrival.end()
        _wait_for(lambda: engine.steps)
        assert time.monotonic() - t0 >= 0.15
        assert engine.steps == [["a"]]
        # a busy engine never waits: the next request runs in the step after the one running
        _add(loop, server, "b")
        _wait_for(lambda: len(engine.steps) == 2)
    finally:
        server.stop()


def test_the_http_side_counts_generation_posts_until_they_are_submitted_or_end():
    arrivals = Arrivals()
    seen = []

    async def submit(request):
        seen.append(arrivals.pending)  # this request is on its way in
        if request.query_params.get("submit"):
            end_arrival(request.scope)
            seen.append(arrivals.pending)
        if request.query_params.get("fail"):
            raise RuntimeError("a handler that fails before submitting")
        return JSONResponse({})

    async def other(request):
        seen.append(arrivals.pending)
        return JSONResponse({})

    app = Starlette(
        routes=[
            Route("/v1/completions", submit, methods=["POST"]),
            Route("/v1/chat/completions", submit, methods=["POST"]),
            Route("/v1/models", other, methods=["GET", "POST"]),
        ]
    )
    client = TestClient(CountArrivals(app, arrivals), raise_server_exceptions=False)
    client.post("/v1/completions?submit=1")
    assert seen == [1, 0] and arrivals.pending == 0
    seen.clear()
    client.post("/v1/chat/completions")  # refused before submission: off at its end
    client.post("/v1/chat/completions?fail=1")
    assert seen == [1, 1] and arrivals.pending == 0
    seen.clear()
    client.get("/v1/models")
    client.post("/v1/models")
    assert seen == [0, 0]


def test_the_count_is_safe_across_threads():
    arrivals = Arrivals()

    def churn():
        for _ in range(2000):
            a = arrivals.begin()
            a.end()
            a.end()  # once only

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert arrivals.pending == 0
