"""The exchange of one client request with the replicas: its attempts (each replica once,
`max_attempts` in all, a jittered backoff between them), the pull of a request the dispatcher
holds, one attempt's request to a replica and the answer passed on, streamed or whole.

A request that has streamed nothing to its client is tried again on another replica after a
refused or cut connection or a 429/5xx answer. A stream is held back until its first token (the
role-only chunk a chat stream opens with included), so "nothing sent" is exact; one cut after
its first token ends with an error event (`data: {"error": ...}`) and `data: [DONE]`. A client
that disconnects cancels its request, which closes the connection to the replica.

What it uses of the router (parts.py's `RouterLike`): its config, clock and metrics, its HTTP
client, the replica set (the replicas available, the requests each runs, their circuit
breakers), its placement (the dispatcher, held requests) and admission (the requests waiting
and open)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import aiohttp

from medha.dispatch.base_dispatcher import ttft_deadline_s
from medha.route.backend import Backend
from medha.route.http_helpers import (
    error_body,
    has_token,
    replica_headers,
    send_error,
    send_raw,
)
from medha.route.parts import RouterLike
from medha.route.prompt import Routing
from medha.route.replicas import REPLICA_DOWN
from medha.route.tracked import TrackedReplica
from medha.server.errors import RequestError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_BACKOFF_S = 2.0  # the longest wait before a retry (--retry-backoff-s doubles up to it)
_ERROR_BODY_LIMIT = 1 << 16  # bytes of a replica's error answer passed on


@dataclass
class _Failed:
    """One attempt that may be tried elsewhere: what to tell the client if none is left."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


class Exchange:
    """One client request through its attempts."""

    def __init__(self, router: RouterLike, scope, receive, send, body, routing: Routing, headers):
        self.router, self.scope, self.receive, self._send = router, scope, receive, send
        self.answered = False  # the last byte went out: a disconnect now is the normal end
        self.body, self.routing = body, routing
        self.path = scope["path"]
        self.sent = False  # whether anything went to the client
        self.client_gone = False
        self.forward_headers = {
            "content-type": "application/json",
            **{k: v for k, v in headers.items() if k.startswith("x-") or k == "accept"},
        }
        # the client's key goes on only where the router has none of its own (a transparent
        # proxy); otherwise each replica gets the router's key for it
        self.client_auth = None if router.has_api_key else headers.get("authorization")
        # the dispatcher's predicted TTFT on the replica of the current try (slack only)
        self.predicted_ttft_s: float | None = None
        self.replica_headers: list[tuple[bytes, bytes]] = []  # of the answering replica
        self._dispatched_to: TrackedReplica | None = None  # a pull gave it to this replica
        self.deadline_s = ttft_deadline_s(
            router.pricing.scheduler_config, routing.request, router.replicas.tracked[0]
        )

    async def run(self) -> None:
        router = self.router
        router.admission.on_start(len(self.body))
        self.holding = True
        task = asyncio.current_task()
        watcher = asyncio.create_task(self._watch_disconnect(task))
        try:
            await self._attempts()
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            router.metrics.requests.labels("cancelled").inc()
        finally:
            watcher.cancel()
            self._release()
            router.admission.on_end()

    def _release(self) -> None:
        """Its first token went out (or it ended): it waits no more, and its body goes."""
        if self.holding:
            self.holding = False
            self.router.admission.on_first_token(len(self.body))

    async def send(self, message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.answered = True
        await self._send(message)

    async def _watch_disconnect(self, task: asyncio.Task) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                if not self.answered:
                    self.client_gone = True
                    task.cancel()
                return

    async def _attempts(self) -> None:
        router, request = self.router, self.routing.request
        placement = router.placement
        tried: set[int] = set()
        failed: _Failed | None = None
        for attempt in range(router.config.max_attempts):
            base = router.config.retry_backoff_s
            if attempt and base:  # full jitter: requests that failed at once retry apart
                await asyncio.sleep(
                    random.uniform(0, min(MAX_BACKOFF_S, base * 2 ** (attempt - 1)))
                )
            candidates = router.replicas.available(tried)
            if not candidates:
                break
            placement.dispatcher.predicted_first_token_s = None
            if attempt == 0 and placement.dispatcher.pulls:
                view = await self._pulled(candidates)
                if view is None:
                    break
            else:
                view = placement.dispatcher.pick(request, router.clock(), candidates)
                if placement.dispatcher.tie_broken:
                    router.metrics.tie_breaks.inc()
            predicted = placement.dispatcher.predicted_first_token_s
            self.predicted_ttft_s = None if predicted is None else predicted - request.arrival_s
            backend = router.replicas.backends[view.replica_id]
            tried.add(backend.replica_id)
            if attempt:
                router.metrics.retries.inc()
            failed = await self._attempt(backend, view)
            if failed is None:
                return
        outcome = "rejected" if failed and failed.status == 429 else "failed"
        router.metrics.requests.labels(outcome).inc()
        if failed is None:
            return await send_error(
                self.send,
                RequestError(
                    "no replica is available (all are out or their circuit breakers open)",
                    None,
                    503,
                    "server_error",
                ),
                retry_after=True,
            )
        await send_raw(self.send, failed.status, failed.body, None, failed.headers)

    async def _pulled(self, candidates: list[TrackedReplica]) -> TrackedReplica | None:
        """The replica that pulls the request from the dispatcher's queue (pla: the replicas
        of its class take it as they have room). After --queue-timeout-s without a pull (a
        pool whose replicas are all out), the dispatcher's `pick` places it instead."""
        router, request = self.router, self.routing.request
        placement = router.placement
        fut = placement.hold(self)
        try:
            view = await asyncio.wait_for(asyncio.shield(fut), router.config.queue_timeout_s)
        except TimeoutError:
            if fut.done():
                view = fut.result()
            else:
                placement.unhold(request.request_id)
                view = placement.dispatcher.pick(request, router.clock(), candidates)
        except BaseException:  # the client left while held
            placement.unhold(request.request_id)
            if fut.done() and not fut.cancelled() and fut.result() is not None:
                fut.result().on_end(request.request_id)  # dispatched there at the pull
                placement.distribute()
            fut.cancel()
            raise
        if view is None and placement.dispatcher is not None:  # held over a change to push
            view = placement.dispatcher.pick(request, router.clock(), candidates)
        return view  # None: every replica was removed while it was held

    def dispatch(self, view: TrackedReplica) -> None:
        """The request is the replica's from now on (its view counts it)."""
        routing = self.routing
        view.on_dispatch(routing.request, self.deadline_s, routing.expected_tokens, routing.stream)
        self._dispatched_to = view

    async def _attempt(self, b: Backend, view: TrackedReplica) -> _Failed | None:
        """One replica's try: None when the request is answered (or cut mid-stream: the client
        had its error event), else what failed."""
        router, rid = self.router, self.routing.request.request_id
        replicas = router.replicas
        if self._dispatched_to is not view:  # (a pull dispatched it already)
            self.dispatch(view)
        self._dispatched_to = None
        router.metrics.dispatched.labels(str(b.replica_id)).inc()
        b.on_sent()
        task = asyncio.current_task()
        replicas.attempt_started(b, task)
        response: aiohttp.ClientResponse | None = None
        try:
            headers = dict(self.forward_headers)
            if b.api_key:
                headers["authorization"] = f"Bearer {b.api_key}"
            elif self.client_auth:
                headers["authorization"] = self.client_auth
            try:
                response = await router.client.post(
                    b.url + self.path, data=self.body, headers=headers
                )
            except aiohttp.ClientConnectorError as e:
                replicas.attempt_refused(b, task, f"connection refused ({e})")
                message = f"replica {b.replica_id} refused the connection"
                return _Failed(502, error_body(message, 502), [])
            if response.status != 200:
                data = await response.content.read(_ERROR_BODY_LIMIT)
                if response.status in RETRY_STATUSES:
                    if response.status != 429:  # a full replica is not a broken one
                        replicas.breaker_failure(b)
                    passed = [
                        (k.encode(), v.encode())
                        for k, v in response.headers.items()
                        if k.lower() in ("content-type", "retry-after")
                    ]
                    return _Failed(response.status, data, passed)
                replicas.breaker_success(b)  # the replica works: the request is the client's
                router.metrics.requests.labels("invalid").inc()
                kind = response.headers.get("content-type", "application/json").encode()
                await send_raw(self.send, response.status, data, kind)
                return None
            self.replica_headers = replica_headers(b, response)
            if self.routing.stream:
                return await self._stream(b, view, response)
            data = await response.read()
            replicas.breaker_success(b)
            view.on_first_token(rid)
            router.placement.distribute()
            self._release()
            kind = response.headers.get("content-type", "application/json").encode()
            await send_raw(self.send, 200, data, kind, self._answer_headers())
            router.metrics.requests.labels("ok").inc()
            return None
        except asyncio.CancelledError as e:
            if not self._replica_down(e):
                raise
            return self._cut(b, "the replica went out")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return self._cut(b, f"the connection to the replica failed ({type(e).__name__})")
        finally:
            replicas.attempt_ended(b, task)
            view.on_end(rid)
            router.placement.distribute()
            if response is not None:
                # an answer read to its end leaves its connection to the pool; one cut short
                # (the client left, the replica failed) closes it: the replica aborts then
                if response.content.at_eof():
                    response.release()
                else:
                    response.close()

    def _replica_down(self, e: asyncio.CancelledError) -> bool:
        """Whether `e` is `ReplicaSet._went_down`'s, and not the client's: then it is taken back, so
        that the request goes on (elsewhere, or to its error event)."""
        if self.client_gone or not e.args or e.args[0] != REPLICA_DOWN:
            return False
        asyncio.current_task().uncancel()
        return True

    def _cut(self, b: Backend, why: str) -> _Failed | None:
        self.router.replicas.breaker_failure(b)
        if not self.sent:
            return _Failed(502, error_body(f"replica {b.replica_id}: {why}", 502), [])
        self._cut_stream = why
        return None

    async def _stream(self, b: Backend, view: TrackedReplica, response: aiohttp.ClientResponse):
        """Hold the stream until its first token, then pass every byte on as it comes."""
        router, rid = self.router, self.routing.request.request_id
        held = bytearray()
        self._cut_stream = None
        try:
            async for chunk in response.content.iter_any():
                if not self.sent:
                    held += chunk
                    if not has_token(held):
                        continue
                    view.on_first_token(rid)
                    ttft = router.clock() - self.routing.request.arrival_s
                    if self.predicted_ttft_s is not None:
                        router.placement.on_predicted_first_token(ttft - self.predicted_ttft_s)
                    router.placement.distribute()
                    router.replicas.breaker_success(b)
                    self._release()
                    router.metrics.ttft.observe(ttft)
                    await self._start_stream()
                    chunk, held = bytes(held), bytearray()
                view.on_tokens(rid, chunk.count(b"data:"))
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            failed = self._cut(b, f"the stream from the replica broke ({type(e).__name__})")
            if failed is not None:
                return failed
        except asyncio.CancelledError as e:
            if not self._replica_down(e):
                raise
            failed = self._cut(b, "the replica went out")
            if failed is not None:
                return failed
        if not self.sent:  # ended before any token: an empty answer, passed on whole
            if not held:
                return self._cut(b, "the replica closed the stream before any token")
            router.replicas.breaker_success(b)
            self._release()
            await self._start_stream()
            await self.send({"type": "http.response.body", "body": bytes(held), "more_body": True})
        if self._cut_stream is not None:
            router.metrics.requests.labels("failed").inc()
            error = {
                "error": {
                    "message": f"stream cut: {self._cut_stream}",
                    "type": "server_error",
                    "param": None,
                    "code": 502,
                }
            }
            tail = b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
            await self.send({"type": "http.response.body", "body": tail, "more_body": False})
            return None
        router.metrics.requests.labels("ok").inc()
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        return None

    def _answer_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers of an answer: which replica gave it (`x-medha-replica`, its id in GET
        /replicas) and its own `x-` headers, and the router's predicted TTFT (ms after it
        received the request) on it, where the dispatcher predicts one."""
        headers = list(self.replica_headers)
        if self.predicted_ttft_s is not None:
            ttft = f"{1000 * self.predicted_ttft_s:.1f}".encode()
            headers.append((b"x-medha-predicted-ttft-ms", ttft))
        return headers

    async def _start_stream(self) -> None:
        self.sent = True
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    *self._answer_headers(),
                ],
            }
        )
