"""One replica as a network peer: its URL, its key, whether it is up (active health checks and
refused connections) and its circuit breaker. Whether the router may send it a request now is
`available`; everything about its load is the TrackedReplica's."""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from medha.scheduler.config import SchedulerConfig

# The round trips of a replica's last this many passed health checks; the quickest is its HTTP
# hop (a slower one waited on a busy replica).
ROUND_TRIPS_KEPT = 20


class Breaker(enum.Enum):
    CLOSED = "closed"  # requests flow
    OPEN = "open"  # refused until `open_until`
    HALF_OPEN = "half_open"  # one trial request is out; its outcome closes or reopens


@dataclass
class Backend:
    replica_id: int
    url: str  # base URL, no trailing slash, no /v1
    api_key: str | None = field(default=None, repr=False)  # the router's key for this replica
    up: bool = False  # starts out until its first health check passes
    passes: int = 0  # health checks passed in a row
    fails: int = 0  # health checks failed in a row
    breaker: Breaker = Breaker.CLOSED
    failures: int = 0  # requests failed in a row, or within the window (the breaker's count)
    open_until: float = 0.0
    trial_out: bool = False
    trial_successes: int = 0  # trials that succeeded since the breaker went half-open
    failure_times: collections.deque = field(default_factory=collections.deque, repr=False)
    down_since: float | None = None
    round_trips: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=ROUND_TRIPS_KEPT), repr=False
    )
    models: list[dict] = field(default_factory=list)  # its /v1/models data, last seen
    # its /medha/predictor: when the router reads it next, its base as last read (None: the
    # router prices it with its own model) and the scheduler config it published with it
    # (None: none, and the router resolves the defaults over that model)
    predictor_due_s: float = 0.0
    predictor_base: dict | None = field(default=None, repr=False)
    scheduler_published: SchedulerConfig | None = field(default=None, repr=False)
    draining: bool = False  # being removed: takes no new request, finishes those it holds
    removed: bool = False  # gone (drained): kept only so that replica ids stay put
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ---- health ------------------------------------------------------------------------------
    def health_passed(self, healthy_after: int) -> bool:
        """Record a passed check; True when this brings the replica in: at its first passed
        check when it was never in (a new replica), after `healthy_after` in a row when it
        went out."""
        self.fails = 0
        self.passes += 1
        back = self.passes >= healthy_after or self.down_since is None
        if not self.up and back:
            self.up, self.down_since = True, None
            return True
        return False

    def round_trip_s(self, took_s: float) -> float:
        """Record a passed check that took `took_s`: its HTTP hop, the quickest recent one."""
        self.round_trips.append(took_s)
        return min(self.round_trips)

    def health_failed(self, unhealthy_after: int) -> bool:
        """Record a failed check; True when this takes the replica out."""
        self.passes = 0
        self.fails += 1
        if self.up and self.fails >= unhealthy_after:
            self.mark_down()
            return True
        return False

    def mark_down(self) -> None:
        """Out now (a check, or a connection the replica refused)."""
        if self.up or self.down_since is None:
            self.down_since = self.clock()
        self.up, self.passes = False, 0

    # ---- circuit breaker ---------------------------------------------------------------------
    def available(self) -> bool:
        """Whether a request may be sent now: up, and its breaker lets one through."""
        if not self.up or self.draining:
            return False
        if self.breaker is Breaker.OPEN and self.clock() >= self.open_until:
            self.breaker, self.trial_out = Breaker.HALF_OPEN, False
        if self.breaker is Breaker.HALF_OPEN:
            return not self.trial_out
        return self.breaker is Breaker.CLOSED

    def on_sent(self) -> None:
        if self.breaker is Breaker.HALF_OPEN:
            self.trial_out = True

    def on_success(self, successes_to_close: int = 1, window_s: float = 0.0) -> None:
        """A request it answered. A half-open breaker closes after `successes_to_close`
        trials in a row succeeded (the next trial goes out after each); a closed one forgets
        the failures in a row (with a window, failures expire by age instead)."""
        if self.breaker is Breaker.HALF_OPEN:
            self.trial_out = False
            self.trial_successes += 1
            if self.trial_successes < successes_to_close:
                return
            self.failure_times.clear()
            self.failures = 0
        elif not window_s:
            self.failures = 0
        self.breaker = Breaker.CLOSED

    def on_failure(self, breaker_failures: int, open_s: float, window_s: float = 0.0) -> None:
        """A request it failed: the breaker opens at `breaker_failures` failures in a row, or
        within the last `window_s` seconds when that is set, and at once when half-open."""
        now = self.clock()
        if window_s:
            times = self.failure_times
            times.append(now)
            while times and times[0] < now - window_s:
                times.popleft()
            self.failures = len(times)
        else:
            self.failures += 1
        if self.breaker is Breaker.HALF_OPEN or self.failures >= breaker_failures:
            self.breaker, self.trial_out, self.trial_successes = Breaker.OPEN, False, 0
            self.open_until = now + open_s
