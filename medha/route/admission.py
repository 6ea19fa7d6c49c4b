"""Admission: whether a request may run now. Past `max_waiting` requests waiting for their first
token, `max_concurrent` open ones or the `rate_limit_rps` token bucket (`RateBucket`) a request
queues, in arrival order; 429 with Retry-After past `queue_size` queued, 408 after
`queue_timeout_s`. And the router's body limits (`body_limits`): 413 past the limit of one
(the body guard's), 429 past the bytes of all bodies the router holds, which it holds until a
request's first token, for its retries."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

from medha.route.config import RouteConfig
from medha.route.http_helpers import send_error
from medha.route.metrics import RouterMetrics
from medha.server.errors import RequestError


def body_limits(config: RouteConfig, max_model_len: int) -> tuple[int, int]:
    """The bytes of one request's body (`--max-request-bytes`; by default 64 a token of the
    replicas' context and 1 MiB, as medha serve) and of all the bodies the router holds
    (`--max-buffered-bytes`; by default 16 times that)."""
    max_request_bytes = config.max_request_bytes or 64 * max_model_len + (1 << 20)
    max_held_bytes = config.max_buffered_bytes or 16 * max_request_bytes
    if max_held_bytes < max_request_bytes:
        raise ValueError(
            f"--max-buffered-bytes ({max_held_bytes}) is below the body limit "
            f"({max_request_bytes}): every large body would get 429"
        )
    return max_request_bytes, max_held_bytes


class RateBucket:
    """`--rate-limit-rps`: a token bucket of requests, `rate` a second up to `burst` (0: one
    second's worth), full at the start. A rate of 0 admits everything."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate, self.clock = rate, clock
        self.burst = float(burst or max(1, math.ceil(rate)))
        self._tokens, self._at = self.burst, clock()

    def _refill(self) -> float:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def ready(self) -> bool:
        return not self.rate or self._refill() >= 1.0

    def take(self) -> None:
        if self.rate:
            self._tokens -= 1.0

    def wait_s(self) -> float:
        """Seconds until it holds a whole request again (0: it does, or there is no limit)."""
        return 0.0 if not self.rate else max(0.0, (1.0 - self._refill()) / self.rate)


class Admission:
    """The requests the router holds (waiting for their first token, open, their bodies' bytes),
    the queue of those it cannot run yet, and the rate bucket."""

    def __init__(
        self,
        config: RouteConfig,
        metrics: RouterMetrics,
        max_held_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.metrics, self.max_held_bytes = config, metrics, max_held_bytes
        self.waiting = 0  # requests without their first token
        self.open = 0  # requests running through the router: waiting, or streaming
        self.held_bytes = 0  # bodies the router holds (queued ones too)
        # requests queued for admission, oldest first (each wakes when its future is set), and
        # how many were woken and have not started yet (they hold the room they were given)
        self._queue: collections.deque[asyncio.Future] = collections.deque()
        self._admitting = 0
        self._bucket = RateBucket(config.rate_limit_rps, config.rate_limit_burst, clock)
        self._refill: asyncio.TimerHandle | None = None  # wakes the queue when the bucket refills

    # ---- a request's life through the router ----------------------------------------------
    def on_start(self, body_bytes: int) -> None:
        """An admitted request starts: it waits for its first token and holds its body."""
        self.waiting += 1
        self.open += 1
        self.held_bytes += body_bytes

    def on_first_token(self, body_bytes: int) -> None:
        """Its first token went out (or it ended): it waits no more, and its body goes."""
        self.waiting -= 1
        self.held_bytes -= body_bytes
        self._wake()

    def on_end(self) -> None:
        self.open -= 1
        self._wake()

    async def body_refused(self, send, body_bytes: int) -> bool:
        """Whether a body of `body_bytes` would take the bodies the router holds past its
        limit: then 429 is sent."""
        if self.held_bytes + body_bytes <= self.max_held_bytes:
            return False
        self.metrics.requests.labels("rejected").inc()
        await send_error(
            send,
            RequestError(
                "the request bodies the router holds exceed its limit of "
                f"{self.max_held_bytes} bytes in all (medha route --max-buffered-bytes); "
                "retry later",
                None,
                429,
                "rate_limit_error",
            ),
            retry_after=True,
        )
        return True

    # ---- the queue ---------------------------------------------------------------------------
    def _has_room(self) -> bool:
        c = self.config
        taken = self._admitting
        return (
            self.waiting + taken < c.max_waiting
            and (not c.max_concurrent or self.open + taken < c.max_concurrent)
            and self._bucket.ready()
        )

    async def admitted(self, send, body_bytes: int) -> bool:
        """Whether a request may run now; else it queues, in arrival order, until there is
        room (True), or gets 429 when the queue is full or 408 after --queue-timeout-s (False,
        the answer sent). A request admitted starts without an await in between, so the room
        it was given is taken before anyone else looks."""
        if self._has_room() and not self._queue:
            self._bucket.take()
            return True
        c = self.config
        if len(self._queue) >= c.queue_size:
            self.metrics.requests.labels("rejected").inc()
            await send_error(
                send,
                RequestError(
                    f"{self.waiting} requests wait for their first token, {self.open} are open "
                    f"and {len(self._queue)} queued (medha route --max-waiting, "
                    "--max-concurrent, --rate-limit-rps, --queue-size); retry later",
                    None,
                    429,
                    "rate_limit_error",
                ),
                retry_after=True,
            )
            return False
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        self.held_bytes += body_bytes
        self.metrics.queued.set(len(self._queue))
        self._wake()  # (sets the bucket's wake; or the bucket refilled since it was looked at)
        try:
            await asyncio.wait_for(asyncio.shield(turn), c.queue_timeout_s)
        except TimeoutError:
            if not turn.done():
                turn.cancel()
                self.metrics.requests.labels("timed_out").inc()
                await send_error(
                    send,
                    RequestError(
                        f"the request waited {c.queue_timeout_s:g} s in the router's queue "
                        "without room to run (medha route --queue-timeout-s)",
                        None,
                        408,
                        "timeout_error",
                        "queue_timeout",
                    ),
                )
                return False
        except BaseException:  # the client left (cancelled) while queued
            if turn.done() and not turn.cancelled():
                self._admitting -= 1  # give back the room it was given
                self._wake()
            turn.cancel()
            raise
        finally:
            self.held_bytes -= body_bytes
            if turn in self._queue:
                self._queue.remove(turn)
            self.metrics.queued.set(len(self._queue))
        self._admitting -= 1
        return True

    def _wake(self) -> None:
        """Give the room a request left (or the bucket refilled) to the oldest queued ones. With
        requests still queued on an empty bucket, wake them again when it next holds a request:
        no other event would (the room the others wait for is given back by requests' events)."""
        queue = self._queue
        while True:
            while queue and self._has_room():
                turn = queue.popleft()
                if not turn.done():
                    self._admitting += 1
                    self._bucket.take()
                    turn.set_result(None)
            if not queue or self._refill is not None:
                break
            wait = self._bucket.wait_s()
            if wait > 0:
                # (a loop may run a timer up to its clock's resolution early: this sets the next)
                self._refill = asyncio.get_running_loop().call_later(wait, self._refilled)
                break
            if not self._has_room():
                break  # the bucket holds a request; the room is what they wait for
            # (the bucket refilled since it was looked at, and there is room: again)
        self.metrics.queued.set(len(queue))

    def _refilled(self) -> None:
        self._refill = None
        self._wake()
