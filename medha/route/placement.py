"""Where each request goes: the dispatcher over the replica set's members (the class `medha
simulate --dispatcher X` runs, made again as the members change), the requests it holds until a
replica pulls them (pla on several replicas), its tolerance (the median error of its recent
predictions of first tokens) and its periodic control."""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from medha.route.config import RouteConfig
from medha.route.prompt import Routing
from medha.route.replicas import ReplicaSet
from medha.route.tracked import TrackedReplica

log = logging.getLogger("medha.route")

# first tokens whose prediction error the dispatcher's tolerance is the median of
PREDICTION_ERRORS = 64


class Held(Protocol):
    """What the placement uses of a request it holds (an exchange, exchange.py)."""

    routing: Routing

    def dispatch(self, view: TrackedReplica) -> None:
        """The request is `view`'s replica's from now on (a pull gave it to it)."""
        ...


class Placement:
    """The dispatcher of the moment over the replica set, and what it holds."""

    def __init__(
        self,
        config: RouteConfig,
        replicas: ReplicaSet,
        scheduler_config: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.replicas, self.clock = config, replicas, clock
        self.scheduler_config = scheduler_config  # the replicas' (the dispatcher plans with it)
        # requests the dispatcher holds until a replica pulls them (pla on several replicas),
        # oldest first: request id -> (the future the pull sets, its exchange)
        self._held: dict[str, tuple[asyncio.Future, Held]] = {}
        self.dispatcher = None
        # |first token - predicted| of the recent requests the dispatcher predicted, seconds:
        # its median is the dispatcher's tolerance (`Dispatcher.tolerance_s`)
        self.prediction_errors: collections.deque[float] = collections.deque(
            maxlen=PREDICTION_ERRORS
        )
        self._control_task: asyncio.Task | None = None
        self.renew()

    def renew(self) -> None:
        """The dispatcher over the members, made again when they change (what it kept of the
        old ones, a round-robin turn or PLA's pools, starts over)."""
        from medha.dispatch.base_dispatcher import DISPATCHERS
        from medha.dispatch.config import BareDispatchSettings

        members = self.replicas.member_views()
        self.dispatcher = (
            DISPATCHERS.get(self.config.dispatcher)(
                members, BareDispatchSettings(), self.scheduler_config
            )
            if members
            else None
        )
        if self.dispatcher is not None:
            self.dispatcher.tolerance_s = self.prediction_error_s()
        # what the old one held, the new one holds (or places at once), in the same order
        held, self._held = self._held, {}
        for fut, exchange in held.values():
            if not fut.done():
                self.hold(exchange, fut)
        self.distribute()

    def prediction_error_s(self) -> float:
        """The median |first token - predicted| of the recent predicted requests (0 before
        any)."""
        return statistics.median(self.prediction_errors) if self.prediction_errors else 0.0

    def on_predicted_first_token(self, error_s: float) -> None:
        """A request's first token came `error_s` after (or, negative, before) the dispatcher
        predicted it."""
        self.prediction_errors.append(abs(error_s))
        if self.dispatcher is not None:
            self.dispatcher.tolerance_s = self.prediction_error_s()

    # ---- held requests (a dispatcher whose replicas pull: pla) --------------------------------
    def hold(self, exchange: Held, fut: asyncio.Future | None = None) -> asyncio.Future:
        """Give `exchange`'s request to the dispatcher: the future is set to the replica it
        goes to, at once for a dispatcher that places at arrival, else when one pulls it."""
        fut = fut or asyncio.get_running_loop().create_future()
        view = (
            None
            if self.dispatcher is None
            else self.dispatcher.route(exchange.routing.request, self.clock())
        )
        if view is not None or self.dispatcher is None:
            fut.set_result(view)
        else:
            self._held[exchange.routing.request.request_id] = (fut, exchange)
            self.distribute()
        return fut

    def unhold(self, request_id: str) -> None:
        """A held request leaves before any pull (its client left, or it waited too long)."""
        if self._held.pop(request_id, None) is not None and self.dispatcher is not None:
            self.dispatcher.drop(request_id)

    def distribute(self) -> None:
        """Let the available replicas pull what the dispatcher holds. Each pulled request is
        dispatched to its replica's view here, before anyone looks again, so that the next
        pull sees it there."""
        d = self.dispatcher
        if d is None or not self._held:
            return
        ready = self.replicas.available()
        try:
            pulled = d.pull(ready, self.clock())
        except Exception:  # a bug here must not stop the router: retried at the next event
            log.exception("dispatcher pull failed")
            return
        for rid, requests in pulled.items():
            view = self.replicas.tracked[rid]
            for r in requests:
                entry = self._held.pop(r.request_id, None)
                if entry is None:
                    continue
                fut, exchange = entry
                exchange.dispatch(view)
                fut.set_result(view)

    def start(self) -> None:
        self._control_task = asyncio.create_task(self._control_loop())

    def stop(self) -> None:
        if self._control_task is not None:
            self._control_task.cancel()

    async def _control_loop(self) -> None:
        """The dispatcher's periodic control (pla's Algorithm 2: it sleeps Delta t, not until
        the next arrival), on the dispatcher of the moment (membership changes make a new one)."""
        while True:
            period = self.dispatcher.control_period_s if self.dispatcher else None
            await asyncio.sleep(period or 1.0)
            dispatcher = self.dispatcher
            if period is None or dispatcher is None or dispatcher.control_period_s is None:
                continue
            try:
                dispatcher.tick(self.clock())
            except Exception:  # a bug here must not stop the control, nor the router
                log.exception("dispatcher control failed")
            self.distribute()  # a pool may have grown
