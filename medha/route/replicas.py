"""The replica set: every replica the router was given or added at run time (membership: added,
drained, removed), its health checks, and what the router learns from each replica (its
models, its cache's size, its context, the model it publishes: priced by pricing.py). A
replica's network state and circuit breaker are its Backend's (backend.py), its load the
TrackedReplica's (tracked.py); here are the lists of both, by replica id, and the requests each
replica runs now, which are cut when it goes out."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from medha.route.backend import Backend
from medha.route.config import RouteConfig
from medha.route.http_helpers import base_url
from medha.route.metrics import RouterMetrics
from medha.route.pricing import Pricing, capacity_tokens, published_scheduler
from medha.route.tracked import TrackedReplica

log = logging.getLogger("medha.route")

DEFAULT_CACHE_TOKENS = 256 * 1024  # a replica's prefix cache when its /metrics does not say
# how often the router reads a replica's model again, in health checks (to see a replica
# restarted with another model): every 10 s at the default interval
PREDICTOR_REFRESH_CHECKS = 20

# The message of the cancellation `_went_down` sends the requests a replica held when it went out
# (a client's disconnect cancels with none).
REPLICA_DOWN = "replica down"


def replica_api_keys(
    config: RouteConfig, urls: list[str], keys: list[str | None] | None
) -> tuple[list[str | None], str | None]:
    """The router's key for each of `urls` (`--replica-api-key`: one for all, or one each), and
    the key a replica added at run time gets unless its request names one."""
    if not urls and not config.api_key:
        raise ValueError(
            "no replicas: give --replica URL (or --spawn N), or --api-key to add them at "
            "run time (POST /replicas)"
        )
    keys = list(keys or [])
    if keys and len(keys) not in (1, len(urls)):
        raise ValueError(
            f"{len(keys)} replica keys for {len(urls)} replicas: give one for all or one each"
        )
    default = keys[0] if len(keys) == 1 else None
    if len(keys) == 1:
        keys = keys * len(urls)
    return keys or [None] * len(urls), default


class ReplicaSet:
    """The replicas by id (each a Backend and a TrackedReplica), their health checks, and the
    requests each runs now."""

    def __init__(
        self,
        config: RouteConfig,
        pricing: Pricing,
        metrics: RouterMetrics,
        urls: list[str],
        keys: list[str | None],
        default_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.pricing, self.metrics, self.clock = config, pricing, metrics, clock
        # the key a replica added at run time gets unless its request names one
        self._default_replica_key = default_key
        # Every replica ever added, by replica_id (its index here); one removed stays, marked
        # `removed`, so that ids stay put. The dispatcher sees the members: those not removed.
        self.backends: list[Backend] = []
        self.tracked: list[TrackedReplica] = []
        self._running: dict[int, set[asyncio.Task]] = {}
        self._health_tasks: dict[int, asyncio.Task] = {}
        self.client: aiohttp.ClientSession | None = None  # (from start())
        # what the router does when the members change (a new dispatcher over them) and when
        # a replica comes in (it may pull held requests): its placement's, set by the router
        self.on_change: Callable[[], None] = lambda: None
        self.on_ready: Callable[[], None] = lambda: None
        for url, key in zip(urls, keys):
            self._new_replica(url, key)

    # ---- membership --------------------------------------------------------------------------
    def _new_replica(self, url: str, key: str | None) -> Backend:
        """A replica joins the lists (out until its first passed health check)."""
        i = len(self.backends)
        b = Backend(i, base_url(url), key, clock=self.clock)
        c = self.config
        cache = c.replica_cache_tokens or DEFAULT_CACHE_TOKENS
        self.backends.append(b)
        t = TrackedReplica(
            i,
            self.pricing.predictor,
            self.pricing.scheduler_config,
            self.pricing.prefill_times,
            c.block_size,
            cache,
            self.clock,
        )
        t.peers = self.tracked  # (every replica's, as the list grows)
        self.tracked.append(t)
        self._running[i] = set()
        return b

    async def add(self, url: str, key: str | None = None) -> Backend:
        """Take a replica in at run time: it is checked at once and serves from its first
        passed check (then every --health-interval-s, as the others)."""
        if any(b.url == base_url(url) for b in self.members()):
            raise ValueError(f"replica {url} is already a member")
        b = self._new_replica(url, key if key is not None else self._default_replica_key)
        self.on_change()
        self.metrics.up.labels(str(b.replica_id)).set(0.0)
        if self.client is not None:  # (started: else start() checks it with the others)
            await self._check(b)
            self._health_tasks[b.replica_id] = asyncio.create_task(self._health_loop(b))
        log.info("replica %d (%s) added", b.replica_id, b.url)
        return b

    def remove(self, replica_id: int) -> Backend:
        """Drain a replica: no new request goes to it; those it holds finish there; then it
        leaves (`removed`), its health checks stop."""
        if not 0 <= replica_id < len(self.backends) or self.backends[replica_id].removed:
            raise KeyError(replica_id)
        b = self.backends[replica_id]
        if not b.draining:
            b.draining = True
            log.info(
                "replica %d (%s) draining: %d requests",
                replica_id,
                b.url,
                len(self._running[replica_id]),
            )
            self.drained(b)
        return b

    def drained(self, b: Backend) -> None:
        """A draining replica with nothing left running leaves."""
        if not b.draining or b.removed or self._running[b.replica_id]:
            return
        b.removed, b.up = True, False
        task = self._health_tasks.pop(b.replica_id, None)
        if task is not None:
            task.cancel()
        self.metrics.up.labels(str(b.replica_id)).set(0.0)
        self.on_change()
        log.info("replica %d (%s) removed", b.replica_id, b.url)

    def members(self) -> list[Backend]:
        return [b for b in self.backends if not b.removed]

    def member_views(self) -> list[TrackedReplica]:
        """The members as the dispatcher sees them."""
        return [self.tracked[b.replica_id] for b in self.backends if not b.removed]

    def available(self, tried: set[int] | frozenset[int] = frozenset()) -> list[TrackedReplica]:
        """The views of the replicas a request may be sent to now (`Backend.available`), but
        those it `tried`."""
        return [
            self.tracked[b.replica_id]
            for b in self.backends
            if b.replica_id not in tried and b.available()
        ]

    # ---- health ------------------------------------------------------------------------------
    async def start(self, client: aiohttp.ClientSession) -> None:
        """Check every member at once, then each in a loop of its own."""
        self.client = client
        await asyncio.gather(*(self._check(b) for b in self.members()))
        for b in self.members():
            self._health_tasks[b.replica_id] = asyncio.create_task(self._health_loop(b))

    def stop(self) -> None:
        for task in self._health_tasks.values():
            task.cancel()

    async def _health_loop(self, b: Backend) -> None:
        """One loop a replica: a busy replica that answers its check late (up to the timeout)
        must not delay the check of one that died (rounds over all of them together took a
        killed replica out 2.3 s after the kill, its neighbour slow under load)."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self._check(b)
            except Exception:  # a bug here must not stop the checks
                log.exception("health check of replica %d failed", b.replica_id)

    async def _check(self, b: Backend) -> None:
        c = self.config
        ok = False
        sent = self.clock()
        try:
            status = await self._get(b.url + "/health", None)
            if status == 404:  # not every server has one
                status = await self._get(b.url + "/v1/models", b.headers())
            ok = status == 200
        except aiohttp.ClientConnectorError:  # nothing listens: out now, as a request's would
            if b.up:
                b.mark_down()
                self._went_down(b, "connection refused (health check)")
        except (TimeoutError, aiohttp.ClientError, OSError):
            ok = False
        if ok:
            self.tracked[b.replica_id].round_trip_s = b.round_trip_s(self.clock() - sent)
            if b.health_passed(c.healthy_after):
                log.info("replica %d (%s) is in", b.replica_id, b.url)
                self.on_ready()
            if not b.models:
                await self._learn(b)
            if self.clock() >= b.predictor_due_s:
                b.predictor_due_s = self.clock() + PREDICTOR_REFRESH_CHECKS * c.health_interval_s
                await self._learn_predictor(b)
        elif b.health_failed(c.unhealthy_after):
            self._went_down(b, "health checks failed")
        self.metrics.up.labels(str(b.replica_id)).set(1.0 if b.up else 0.0)

    async def _get(self, url: str, headers: dict | None, read: bool = False):
        """GET within the health timeout: the status, or with `read` (status, body text)."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        async with self.client.get(url, headers=headers, timeout=timeout) as r:
            if not read:
                return r.status
            return r.status, await r.text()

    async def _learn(self, b: Backend) -> None:
        """The replica's models, and its prefix cache's size when its /metrics says."""
        try:
            status, text = await self._get(b.url + "/v1/models", b.headers(), read=True)
            data = json.loads(text).get("data") if status == 200 else None
            if isinstance(data, list):
                b.models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
                if self.pricing.learn_context(b.models, self.tracked):
                    self.metrics.context.set(self.pricing.context)
            if not self.config.replica_cache_tokens:
                status, text = await self._get(b.url + "/metrics", None, read=True)
                tokens = capacity_tokens(text) if status == 200 else None
                if tokens:
                    t = self.tracked[b.replica_id]
                    t.index.capacity_blocks = max(1, tokens // t.block_size)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, AttributeError):
            pass

    async def _learn_predictor(self, b: Backend) -> None:
        """The batch-time model the replica plans with (`medha serve`'s GET /medha/predictor),
        which the router prices that replica's work with from then on, instead of its own
        --model and --predictor: the base of it (model spec, hardware spec or profile,
        layout), read again every 20 checks to see a replica restarted with another. Not its
        online correction: fitted per replica to the batches each ran, it differed by up to
        20% between two replicas on identical cores, and a router that took it sent 70-80%
        of a multi-turn run to the one whose fit was faster (docs/route.md); the replica's
        speed under load is what the router measures itself (`slowdown`). With it, the
        scheduler config the replica runs, its defaults as it resolved them (again as its
        model is corrected) and whatever its flags set (`--policy`, `--no-overload-steps`,
        ...): the rules the router's model of it applies; a replica that publishes none
        gets the defaults resolved over its model under the router's --policy. A replica
        without the endpoint (vLLM's server), or one that answers something unusable, keeps
        the router's model."""
        from medha.perf.published import DescriptionError, base_of

        t = self.tracked[b.replica_id]
        try:
            status, text = await self._get(b.url + "/medha/predictor", b.headers(), read=True)
            if status != 200:
                if status == 404 and b.predictor_base is not None:  # now a server without one
                    self.pricing.price_as_own(t)
                    b.predictor_base = b.scheduler_published = None
                return
            description = json.loads(text)
            if not isinstance(description, dict):
                raise DescriptionError("not an object")
            base, published = base_of(description), published_scheduler(description)
            new_base = base != b.predictor_base  # first seen (or the replica was restarted)
            if new_base or published != b.scheduler_published:
                # (building a fitted profile's model takes seconds, a walk a fraction of one:
                # off the event loop)
                predictor, config, walk = await asyncio.to_thread(
                    self.pricing.published_model, base if new_base else None, published, t.predictor
                )
                self.pricing.price_with(t, predictor, config, walk)
                b.predictor_base, b.scheduler_published = base, published
                log.info(
                    "replica %d: priced with its own model, %s; %s",
                    b.replica_id,
                    t.describe(),
                    "its scheduler config" if published else "the defaults resolved over it",
                )
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass  # the health check says what is wrong with a replica that does not answer
        except Exception as e:  # whatever a replica answers, it must not stop the router
            log.warning("replica %d: its /medha/predictor is not usable: %s", b.replica_id, e)

    def breaker_success(self, b: Backend) -> None:
        c = self.config
        b.on_success(c.breaker_successes, c.breaker_window_s)

    def breaker_failure(self, b: Backend) -> None:
        c = self.config
        b.on_failure(c.breaker_failures, c.breaker_open_s, c.breaker_window_s)

    def _went_down(self, b: Backend, why: str) -> None:
        log.warning("replica %d (%s) is out: %s", b.replica_id, b.url, why)
        self.metrics.up.labels(str(b.replica_id)).set(0.0)
        for task in list(self._running[b.replica_id]):
            task.cancel(REPLICA_DOWN)

    # ---- the requests each replica runs ------------------------------------------------------
    def requests(self, b: Backend) -> int:
        """How many requests replica `b` runs now."""
        return len(self._running[b.replica_id])

    def attempt_started(self, b: Backend, task: asyncio.Task) -> None:
        """`task` sends a request to `b`: it is cut if `b` goes out."""
        self._running[b.replica_id].add(task)

    def attempt_refused(self, b: Backend, task: asyncio.Task, why: str) -> None:
        """`b` refused `task`'s connection: nothing listens, so it is out at once (the other
        requests it held are cut, not `task`, which tries elsewhere)."""
        self._running[b.replica_id].discard(task)  # not cancelled with the others it held
        b.mark_down()
        self._went_down(b, why)
        self.breaker_failure(b)

    def attempt_ended(self, b: Backend, task: asyncio.Task) -> None:
        """`task`'s request left `b` (answered, failed or cut): a draining `b` may leave now."""
        self._running[b.replica_id].discard(task)
        self.drained(b)
