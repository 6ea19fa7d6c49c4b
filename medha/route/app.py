"""`medha route`'s proxy: an ASGI app (no framework on the request path: its cost is the router's
overhead) in front of OpenAI-compatible replicas.

A generation request is read once for routing (medha/route/prompt.py), given to the dispatcher
(the class `medha simulate` runs, over the router's TrackedReplica models), and its body sent to
the replica unchanged. Faults:

- A replica is out after `unhealthy_after` failed health checks, or at once when it refuses a
  connection; back after `healthy_after` passed ones. Requests it holds are cut when it goes
  out, so a replica that hangs cannot hold a stream open.
- A request that has streamed nothing to its client is tried again on another replica (each
  replica once, `max_attempts` in all) after a refused or cut connection or a 429/5xx answer.
  A stream is held back until its first token (the role-only chunk a chat stream opens with
  included), so "nothing sent" is exact.
- A stream cut after its first token ends with an error event (`data: {"error": ...}`) and
  `data: [DONE]`: the client learns it at once and never hangs.
- A replica's circuit breaker opens after `breaker_failures` failed requests in a row and lets
  one trial request through after `breaker_open_s`.
- A client that disconnects cancels its request, which closes the connection to the replica
  (medha serve aborts the request then).
- Body limits as `medha serve` (413 before reading; 429 past the bytes of all bodies the router
  holds, which it holds until a request's first token, for its retries), and admission: past
  `max_waiting` requests waiting for their first token, `max_concurrent` open ones or the
  `rate_limit_rps` token bucket a request queues, in arrival order; 429 with Retry-After past
  `queue_size` queued, 408 after `queue_timeout_s`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import random
import secrets
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from medha.dispatch.base_dispatcher import ttft_deadline_s
from medha.route.backend import Backend
from medha.route.config import RouteConfig
from medha.route.prompt import Routing, TokenCache, load_tokenizer, prompt_pieces, read_request
from medha.route.tracked import TrackedReplica
from medha.server.body_guard import BodyGuard
from medha.server.errors import RequestError

log = logging.getLogger("medha.route")

GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
DEFAULT_OUTPUT_TOKENS = 128  # a request without max_tokens: a typical answer's length
DEFAULT_CACHE_TOKENS = 256 * 1024  # a replica's prefix cache when its /metrics does not say
MAX_BACKOFF_S = 2.0  # the longest wait before a retry (--retry-backoff-s doubles up to it)
MAX_CONTEXT = 1 << 24  # tokens: a replica's reported context past this is not believed
# how often the router reads a replica's model again, in health checks (to see a replica
# restarted with another model): every 10 s at the default interval
PREDICTOR_REFRESH_CHECKS = 20
# first tokens whose prediction error the dispatcher's tolerance is the median of
PREDICTION_ERRORS = 64
_ERROR_BODY_LIMIT = 1 << 16  # bytes of a replica's error answer passed on
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# The message of the cancellation `_went_down` sends the requests a replica held when it went out
# (a client's disconnect cancels with none).
_REPLICA_DOWN = "replica down"


@dataclass
class _Failed:
    """One attempt that may be tried elsewhere: what to tell the client if none is left."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "medha_router_requests",
            "Requests by outcome: ok, failed (no replica could serve it, or cut mid-stream), "
            "invalid (4xx from the router or a replica), rejected (429), timed_out (408: "
            "queued past --queue-timeout-s), cancelled (client gone)",
            ["outcome"],
            registry=r,
        )
        self.retries = Counter(
            "medha_router_retries", "Attempts tried again on another replica", registry=r
        )
        self.dispatched = Counter(
            "medha_router_dispatched", "Attempts sent to each replica", ["replica"], registry=r
        )
        self.up = Gauge(
            "medha_router_replica_up", "1 while a replica is in", ["replica"], registry=r
        )
        self.live = Gauge(
            "medha_router_replica_requests",
            "Requests each replica holds now",
            ["replica"],
            registry=r,
        )
        self.slowdown = Gauge(
            "medha_router_replica_slowdown",
            "Each replica's measured time to first token over the time its model predicts "
            "(the router's measure of its speed under load)",
            ["replica"],
            registry=r,
        )
        self.ttft = Histogram(
            "medha_router_time_to_first_token_seconds",
            "Arrival at the router to the first token passed on (streams)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prediction_error = Gauge(
            "medha_router_prediction_error_seconds",
            "The median |first token - predicted| over the recent requests whose first token "
            "the dispatcher predicted (slack): its tolerance, within which choices tie",
            registry=r,
        )
        self.tie_breaks = Counter(
            "medha_router_tie_breaks",
            "Picks the prediction error changed: choices within it of the best tie, and the "
            "tie went to the replica that spends less time on the request (its cache), or "
            "for a prompt their caches cannot tell apart, to the one sent fewest lately",
            registry=r,
        )
        self.context = Gauge(
            "medha_router_context_tokens",
            "The longest context the router prices prompts to: its --model's, or a longer one "
            "a replica reports in /v1/models (max_model_len)",
            registry=r,
        )
        self.queued = Gauge(
            "medha_router_queued",
            "Requests queued for admission now (at --max-waiting or --max-concurrent)",
            registry=r,
        )
        for outcome in ("ok", "failed", "invalid", "rejected", "timed_out", "cancelled"):
            self.requests.labels(outcome)


def auto_predictor(model: str, hardware: str) -> str:
    """The profile `medha profile` wrote for `model` on `hardware` in medha's cache (the newest),
    else the roofline: what the replicas plan with by default on this machine."""
    from medha.perf.hardware_specs import cache_dir

    root = cache_dir() / "profiles"
    found = sorted(root.glob(f"{model}-{hardware}-*.json"), key=lambda p: p.stat().st_mtime)
    return f"profiled:{found[-1]}" if found else "roofline"


def published_scheduler(description: dict):
    """The scheduler config a replica publishes beside its model (None: none, as older replicas),
    checked as input from the network: DescriptionError for anything `SchedulerConfig` refuses
    or a config whose defaults are not resolved."""
    from medha.perf.published import DescriptionError
    from medha.scheduler.config import SchedulerConfig

    data = description.get("scheduler")
    if data is None:
        return None
    if not isinstance(data, dict):
        raise DescriptionError("scheduler must be an object")
    try:
        config = SchedulerConfig(**data)
    except (TypeError, ValueError) as e:
        raise DescriptionError(f"scheduler: {e}") from None
    if not config.is_resolved:
        raise DescriptionError("scheduler: its defaults are not resolved")
    return config


class Router:
    def __init__(
        self,
        config: RouteConfig,
        urls: list[str],
        replica_keys: list[str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from medha.perf import make_predictor
        from medha.scheduler.config import SchedulerConfig
        from medha.scheduler.config_defaults import resolve_config
        from medha.scheduler.packers import replica_prefill_times

        if not urls and not config.api_key:
            raise ValueError(
                "no replicas: give --replica URL (or --spawn N), or --api-key to add them at "
                "run time (POST /replicas)"
            )
        keys = list(replica_keys or [])
        if keys and len(keys) not in (1, len(urls)):
            raise ValueError(
                f"{len(keys)} replica keys for {len(urls)} replicas: give one for all or one each"
            )
        # the key a replica added at run time gets unless its request names one
        self._default_replica_key = keys[0] if len(keys) == 1 else None
        if len(keys) == 1:
            keys = keys * len(urls)
        self.config, self.clock = config, clock
        spec = config.predictor
        if spec == "auto":
            spec = auto_predictor(config.model, config.hardware)
        self.predictor = make_predictor(spec, config.model, config.hardware)
        # The replicas' scheduler config (of it, only --policy is known: the rest are the
        # defaults), resolved as their schedulers resolve it, and the prefill-time walk those
        # read (one function for both); no scheduler is built. The tracked replicas make the
        # policy, which rejects an unknown name.
        self.scheduler_config = scheduler_config = resolve_config(
            SchedulerConfig(policy=config.policy), self.predictor
        )
        self.prefill_times = replica_prefill_times(scheduler_config, self.predictor)
        # the longest context a replica reported (prompts are priced up to it)
        self.context = self.prefill_times.max_len
        # Every replica ever added, by replica_id (its index here); one removed stays, marked
        # `removed`, so that ids stay put. The dispatcher sees the members: those not removed.
        self.backends: list[Backend] = []
        self.tracked: list[TrackedReplica] = []
        self._running: dict[int, set[asyncio.Task]] = {}
        self._health_tasks: dict[int, asyncio.Task] = {}
        self._control_task: asyncio.Task | None = None
        # requests the dispatcher holds until a replica pulls them (pla on several replicas),
        # oldest first: request id -> (the future the pull sets, its exchange)
        self._held: dict[str, tuple[asyncio.Future, _Exchange]] = {}
        self.dispatcher = None
        # |first token - predicted| of the recent requests the dispatcher predicted, seconds:
        # its median is the dispatcher's tolerance (`Dispatcher.tolerance_s`)
        self.prediction_errors: collections.deque[float] = collections.deque(
            maxlen=PREDICTION_ERRORS
        )
        for url, key in zip(urls, keys or [None] * len(urls)):
            self._new_replica(url, key)
        self._new_dispatcher()
        self.tokens = TokenCache(load_tokenizer(config.tokenizer))
        self.max_request_bytes = config.max_request_bytes or (
            64 * self.scheduler_config.max_model_len + (1 << 20)
        )
        self.max_held_bytes = config.max_buffered_bytes or 16 * self.max_request_bytes
        if self.max_held_bytes < self.max_request_bytes:
            raise ValueError(
                f"--max-buffered-bytes ({self.max_held_bytes}) is below the body limit "
                f"({self.max_request_bytes}): every large body would get 429"
            )
        self.metrics = RouterMetrics()
        self.metrics.context.set(self.context)
        self.waiting = 0  # requests without their first token
        self.open = 0  # requests running through the router: waiting, or streaming
        self.held_bytes = 0  # bodies the router holds (queued ones too)
        # requests queued for admission, oldest first (each wakes when its future is set), and
        # how many were woken and have not started yet (they hold the room they were given)
        self._queue: collections.deque[asyncio.Future] = collections.deque()
        self._admitting = 0
        self._bucket = RateBucket(config.rate_limit_rps, config.rate_limit_burst, clock)
        self._refill: asyncio.TimerHandle | None = None  # wakes the queue when the bucket refills
        self._client: aiohttp.ClientSession | None = None
        self._api_key = config.api_key.encode() if config.api_key else None

    # ---- membership --------------------------------------------------------------------------
    def _new_replica(self, url: str, key: str | None) -> Backend:
        """A replica joins the lists (out until its first passed health check)."""
        i = len(self.backends)
        b = Backend(i, _base_url(url), key, clock=self.clock)
        c = self.config
        cache = c.replica_cache_tokens or DEFAULT_CACHE_TOKENS
        self.backends.append(b)
        t = TrackedReplica(
            i,
            self.predictor,
            self.scheduler_config,
            self.prefill_times,
            c.block_size,
            cache,
            self.clock,
        )
        t.peers = self.tracked  # (every replica's, as the list grows)
        self.tracked.append(t)
        self._running[i] = set()
        return b

    def _new_dispatcher(self) -> None:
        """The dispatcher over the members, made again when they change (what it kept of the
        old ones, a round-robin turn or PLA's pools, starts over)."""
        from medha.dispatch.base_dispatcher import DISPATCHERS
        from medha.dispatch.config import BareDispatchSettings

        members = [self.tracked[b.replica_id] for b in self.backends if not b.removed]
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
                self._hold(exchange, fut)
        self._distribute()

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
    def _hold(self, exchange: _Exchange, fut: asyncio.Future | None = None) -> asyncio.Future:
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
            self._distribute()
        return fut

    def _unhold(self, request_id: str) -> None:
        """A held request leaves before any pull (its client left, or it waited too long)."""
        if self._held.pop(request_id, None) is not None and self.dispatcher is not None:
            self.dispatcher.drop(request_id)

    def _distribute(self) -> None:
        """Let the available replicas pull what the dispatcher holds. Each pulled request is
        dispatched to its replica's view here, before anyone looks again, so that the next
        pull sees it there."""
        d = self.dispatcher
        if d is None or not self._held:
            return
        ready = [self.tracked[b.replica_id] for b in self.backends if b.available()]
        try:
            pulled = d.pull(ready, self.clock())
        except Exception:  # a bug here must not stop the router: retried at the next event
            log.exception("dispatcher pull failed")
            return
        for rid, requests in pulled.items():
            view = self.tracked[rid]
            for r in requests:
                entry = self._held.pop(r.request_id, None)
                if entry is None:
                    continue
                fut, exchange = entry
                exchange.dispatch(view)
                fut.set_result(view)

    async def add_replica(self, url: str, key: str | None = None) -> Backend:
        """Take a replica in at run time: it is checked at once and serves from its first
        passed check (then every --health-interval-s, as the others)."""
        if any(b.url == _base_url(url) for b in self.members()):
            raise ValueError(f"replica {url} is already a member")
        b = self._new_replica(url, key if key is not None else self._default_replica_key)
        self._new_dispatcher()
        self.metrics.up.labels(str(b.replica_id)).set(0.0)
        if self._client is not None:  # (started: else start() checks it with the others)
            await self._check(b)
            self._health_tasks[b.replica_id] = asyncio.create_task(self._health_loop(b))
        log.info("replica %d (%s) added", b.replica_id, b.url)
        return b

    def remove_replica(self, replica_id: int) -> Backend:
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
            self._drained(b)
        return b

    def _drained(self, b: Backend) -> None:
        """A draining replica with nothing left running leaves."""
        if not b.draining or b.removed or self._running[b.replica_id]:
            return
        b.removed, b.up = True, False
        task = self._health_tasks.pop(b.replica_id, None)
        if task is not None:
            task.cancel()
        self.metrics.up.labels(str(b.replica_id)).set(0.0)
        self._new_dispatcher()
        log.info("replica %d (%s) removed", b.replica_id, b.url)

    def members(self) -> list[Backend]:
        return [b for b in self.backends if not b.removed]

    # ---- life --------------------------------------------------------------------------------
    async def start(self) -> None:
        # aiohttp, not httpx: forwarding one request costs 0.8 ms of CPU with it against 2 ms
        # (measured on this 2-core machine; docs/route.md), and that is the router's overhead
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,
        )
        await asyncio.gather(*(self._check(b) for b in self.members()))
        for b in self.members():
            self._health_tasks[b.replica_id] = asyncio.create_task(self._health_loop(b))
        self._control_task = asyncio.create_task(self._control_loop())

    async def stop(self) -> None:
        for task in [*self._health_tasks.values(), self._control_task]:
            if task is not None:
                task.cancel()
        if self._client is not None:
            await self._client.close()

    def asgi(self):
        """The app: this router behind the body guard."""
        return BodyGuard(self, self.max_request_bytes, self.max_held_bytes, "medha route")

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
            self._distribute()  # a pool may have grown

    # ---- health ------------------------------------------------------------------------------
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
                self._distribute()
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
        async with self._client.get(url, headers=headers, timeout=timeout) as r:
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
                self._learn_context(b.models)
            if not self.config.replica_cache_tokens:
                status, text = await self._get(b.url + "/metrics", None, read=True)
                tokens = _capacity_tokens(text) if status == 200 else None
                if tokens:
                    t = self.tracked[b.replica_id]
                    t.index.capacity_blocks = max(1, tokens // t.block_size)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, AttributeError):
            pass

    def _learn_context(self, models: list[dict]) -> None:
        """A replica that serves a longer context than the router's --model (its /v1/models'
        `max_model_len`, as medha serve and vLLM report it): the router prices prompts up to
        it from then on, on every replica."""
        lengths = [m.get("max_model_len") for m in models]
        longest = max((n for n in lengths if type(n) is int and 0 < n <= MAX_CONTEXT), default=0)
        if longest <= self.context:
            return
        self.context = longest
        self.prefill_times = self._walk(self.scheduler_config, self.predictor)
        for t in self.tracked:
            self._price_with(t, t.predictor, t.scheduler_config)
        self.metrics.context.set(longest)
        log.info(
            "a replica serves %d tokens of context: the router prices prompts up to it", longest
        )

    def _walk(self, config, predictor):
        """The prefill-time walk of a replica running `config` on `predictor`, to the
        longest context known."""
        from medha.scheduler.packers import replica_prefill_times

        if config.max_model_len < self.context:
            config = dataclasses.replace(config, max_model_len=self.context)
        return replica_prefill_times(config, predictor)

    def _price_with(self, t: TrackedReplica, predictor, config, walk=None) -> None:
        """Replica `t` priced from now on with `predictor` under its scheduler `config`: the
        router's own model shares one walk (`prefill_times`, which a replica added later gets
        too), a replica's published one has its own (`walk`, when the caller made it off the
        event loop)."""
        own = predictor is self.predictor and config is self.scheduler_config
        if walk is None:
            walk = self.prefill_times if own else self._walk(config, predictor)
        t.set_model(predictor, config, walk)

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
        from medha.perf.published import DescriptionError, base_of, predictor_from_description
        from medha.scheduler.config import SchedulerConfig
        from medha.scheduler.config_defaults import resolve_config

        def build(base: dict | None, published: SchedulerConfig | None, predictor):
            if base is not None:
                predictor = predictor_from_description(base)
            # the replica's own config, or resolved as the replica resolves its defaults
            config = published or resolve_config(
                SchedulerConfig(policy=self.config.policy), predictor
            )
            return predictor, config, self._walk(config, predictor)

        t = self.tracked[b.replica_id]
        try:
            status, text = await self._get(b.url + "/medha/predictor", b.headers(), read=True)
            if status != 200:
                if status == 404 and b.predictor_base is not None:  # now a server without one
                    self._price_with(t, self.predictor, self.scheduler_config)
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
                    build, base if new_base else None, published, t.predictor
                )
                self._price_with(t, predictor, config, walk)
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
            task.cancel(_REPLICA_DOWN)

    # ---- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        if kind != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method in ("GET", "HEAD"):
            members = self.members()
            n = sum(b.up for b in members)
            status = 200 if n else 503
            body = {"healthy_replicas": n, "replicas": len(members)}
            return await _json(send, status, body)
        if path == "/metrics" and method == "GET":
            for t in self.tracked:
                self.metrics.live.labels(str(t.replica_id)).set(t.num_live)
                self.metrics.slowdown.labels(str(t.replica_id)).set(t.slowdown)
            self.metrics.prediction_error.set(self.prediction_error_s())
            return await _raw(send, 200, generate_latest(self.metrics.registry), b"text/plain")
        if path == "/replicas" or path.startswith("/replicas/"):
            return await self._admin(scope, receive, send, path, method)
        if path in GENERATION_PATHS or path == "/v1/models":
            if not self._authorized(scope):
                return await _error(send, _unauthorized())
            if path == "/v1/models" and method == "GET":
                return await _json(send, 200, {"object": "list", "data": self._models()})
            if method == "POST" and path in GENERATION_PATHS:
                return await self._generate(scope, receive, send, GENERATION_PATHS[path])
            return await _error(send, RequestError("method not allowed", None, 405))
        return await _error(send, RequestError(f"no route {path}", None, 404, "not_found_error"))

    async def _admin(self, scope, receive, send, path: str, method: str) -> None:
        """The members at run time, behind the API key (a router without one has no admin
        endpoints: anyone could point it anywhere): GET /replicas lists them, POST /replicas
        {"url": ..., "api_key": optional} adds one, DELETE /replicas/ID drains and removes
        one (202; the listing says `draining` until it is gone)."""
        if self._api_key is None:
            return await _error(
                send,
                RequestError(
                    "replicas are managed at run time only behind a key (medha route --api-key)",
                    None,
                    403,
                    "permission_error",
                ),
            )
        if not self._authorized(scope):
            return await _error(send, _unauthorized())
        if path == "/replicas" and method == "GET":
            return await _json(send, 200, {"replicas": [self._describe(b) for b in self.members()]})
        if path == "/replicas" and method == "POST":
            try:
                payload = json.loads(await _read_body(receive))
            except (ValueError, RecursionError):
                payload = None
            url = payload.get("url") if isinstance(payload, dict) else None
            key = payload.get("api_key") if isinstance(payload, dict) else None
            if (
                not isinstance(url, str)
                or len(url) > 2048
                or not url.startswith(("http://", "https://"))
                or not (key is None or isinstance(key, str))
            ):
                return await _error(
                    send,
                    RequestError(
                        'expected {"url": "http://HOST:PORT", "api_key": optional string}', "url"
                    ),
                )
            try:
                b = await self.add_replica(url, key)
            except ValueError as e:
                return await _error(send, RequestError(str(e), "url", 409, "conflict_error"))
            return await _json(send, 201, self._describe(b))
        if path.startswith("/replicas/") and method == "DELETE":
            tail = path.removeprefix("/replicas/")
            try:
                b = self.remove_replica(int(tail) if tail.isdigit() and len(tail) < 10 else -1)
            except KeyError:
                return await _error(
                    send, RequestError(f"no replica {tail!r}", None, 404, "not_found_error")
                )
            return await _json(send, 202, self._describe(b))
        return await _error(send, RequestError("method not allowed", None, 405))

    def _describe(self, b: Backend) -> dict:
        t = self.tracked[b.replica_id]
        return {
            "id": b.replica_id,
            "url": b.url,
            "up": b.up,
            "draining": b.draining and not b.removed,
            "removed": b.removed,
            "requests": len(self._running[b.replica_id]),
            # what the router prices its work with: its own model once read, else the router's
            "predictor": t.describe(),
            "predictor_from_replica": b.predictor_base is not None,
            # its speed as measured against that model, and its HTTP hop (tracked.py)
            "slowdown": round(t.slowdown, 4),
            "round_trip_ms": round(1e3 * t.round_trip_s, 3),
            # the scheduler config its model applies: the one it published, else the defaults
            "scheduler_from_replica": b.scheduler_published is not None,
        }

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _authorized(self, scope) -> bool:
        if self._api_key is None:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return secrets.compare_digest(given, b"Bearer " + self._api_key)

    def _models(self) -> list[dict]:
        seen: dict[str, dict] = {}
        for b in self.backends:
            if b.up:
                for m in b.models:
                    seen.setdefault(m["id"], m)
        return list(seen.values())

    # ---- generation --------------------------------------------------------------------------
    async def _generate(self, scope, receive, send, chat: bool) -> None:
        body = await _read_body(receive)
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            payload = None
        if not isinstance(payload, dict):
            self.metrics.requests.labels("invalid").inc()
            return await _error(send, RequestError("the request body must be a JSON object"))
        if not self.tracked:  # (started with none, none added yet)
            self.metrics.requests.labels("failed").inc()
            return await _error(
                send,
                RequestError(
                    "the router has no replicas yet (POST /replicas adds one)",
                    None,
                    503,
                    "server_error",
                ),
                retry_after=True,
            )
        if self.held_bytes + len(body) > self.max_held_bytes:
            self.metrics.requests.labels("rejected").inc()
            return await _error(
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
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        now = self.clock()  # its arrival: tokenizing is part of its wait
        try:
            tokens = await self.tokens.tokens(prompt_pieces(payload, chat))
            routing = read_request(
                payload, tokens, uuid.uuid4().hex, now, headers, DEFAULT_OUTPUT_TOKENS
            )
            exchange = _Exchange(self, scope, receive, send, body, routing, headers)
        except Exception:
            # a fault of the router's own (its estimates must never fail a request): the
            # request ends with an error that says so, counted, and the router goes on
            log.exception("the router could not route a request")
            self.metrics.requests.labels("failed").inc()
            return await _error(
                send,
                RequestError(
                    "the router failed to route this request (a fault of the router's; its "
                    "log has the details)",
                    None,
                    500,
                    "server_error",
                ),
            )
        if not await self._admitted(send, len(body)):
            return
        await exchange.run()

    # ---- admission ---------------------------------------------------------------------------
    def _has_room(self) -> bool:
        c = self.config
        taken = self._admitting
        return (
            self.waiting + taken < c.max_waiting
            and (not c.max_concurrent or self.open + taken < c.max_concurrent)
            and self._bucket.ready()
        )

    async def _admitted(self, send, body_bytes: int) -> bool:
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
            await _error(
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
                await _error(
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


class _Exchange:
    """One client request through its attempts."""

    def __init__(self, router: Router, scope, receive, send, body, routing: Routing, headers):
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
        self.client_auth = headers.get("authorization") if router._api_key is None else None
        # the dispatcher's predicted TTFT on the replica of the current try (slack only)
        self.predicted_ttft_s: float | None = None
        self.replica_headers: list[tuple[bytes, bytes]] = []  # of the answering replica
        self._dispatched_to: TrackedReplica | None = None  # a pull gave it to this replica
        self.deadline_s = ttft_deadline_s(
            router.scheduler_config, routing.request, router.tracked[0]
        )

    async def run(self) -> None:
        router = self.router
        router.waiting += 1
        router.open += 1
        router.held_bytes += len(self.body)
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
            router.open -= 1
            router._wake()

    def _release(self) -> None:
        """Its first token went out (or it ended): it waits no more, and its body goes."""
        if self.holding:
            self.holding = False
            self.router.waiting -= 1
            self.router.held_bytes -= len(self.body)
            self.router._wake()

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
        tried: set[int] = set()
        failed: _Failed | None = None
        for attempt in range(router.config.max_attempts):
            base = router.config.retry_backoff_s
            if attempt and base:  # full jitter: requests that failed at once retry apart
                await asyncio.sleep(
                    random.uniform(0, min(MAX_BACKOFF_S, base * 2 ** (attempt - 1)))
                )
            candidates = [
                router.tracked[b.replica_id]
                for b in router.backends
                if b.replica_id not in tried and b.available()
            ]
            if not candidates:
                break
            router.dispatcher.predicted_first_token_s = None
            if attempt == 0 and router.dispatcher.pulls:
                view = await self._pulled(candidates)
                if view is None:
                    break
            else:
                view = router.dispatcher.pick(request, router.clock(), candidates)
                if router.dispatcher.tie_broken:
                    router.metrics.tie_breaks.inc()
            predicted = router.dispatcher.predicted_first_token_s
            self.predicted_ttft_s = None if predicted is None else predicted - request.arrival_s
            backend = router.backends[view.replica_id]
            tried.add(backend.replica_id)
            if attempt:
                router.metrics.retries.inc()
            failed = await self._attempt(backend, view)
            if failed is None:
                return
        outcome = "rejected" if failed and failed.status == 429 else "failed"
        router.metrics.requests.labels(outcome).inc()
        if failed is None:
            return await _error(
                self.send,
                RequestError(
                    "no replica is available (all are out or their circuit breakers open)",
                    None,
                    503,
                    "server_error",
                ),
                retry_after=True,
            )
        await _raw(self.send, failed.status, failed.body, None, failed.headers)

    async def _pulled(self, candidates: list[TrackedReplica]) -> TrackedReplica | None:
        """The replica that pulls the request from the dispatcher's queue (pla: the replicas
        of its class take it as they have room). After --queue-timeout-s without a pull (a
        pool whose replicas are all out), the dispatcher's `pick` places it instead."""
        router, request = self.router, self.routing.request
        fut = router._hold(self)
        try:
            view = await asyncio.wait_for(asyncio.shield(fut), router.config.queue_timeout_s)
        except TimeoutError:
            if fut.done():
                view = fut.result()
            else:
                router._unhold(request.request_id)
                view = router.dispatcher.pick(request, router.clock(), candidates)
        except BaseException:  # the client left while held
            router._unhold(request.request_id)
            if fut.done() and not fut.cancelled() and fut.result() is not None:
                fut.result().on_end(request.request_id)  # dispatched there at the pull
                router._distribute()
            fut.cancel()
            raise
        if view is None and router.dispatcher is not None:  # held over a change to push
            view = router.dispatcher.pick(request, router.clock(), candidates)
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
        if self._dispatched_to is not view:  # (a pull dispatched it already)
            self.dispatch(view)
        self._dispatched_to = None
        router.metrics.dispatched.labels(str(b.replica_id)).inc()
        b.on_sent()
        task = asyncio.current_task()
        running = router._running[b.replica_id]
        running.add(task)
        response: aiohttp.ClientResponse | None = None
        try:
            headers = dict(self.forward_headers)
            if b.api_key:
                headers["authorization"] = f"Bearer {b.api_key}"
            elif self.client_auth:
                headers["authorization"] = self.client_auth
            try:
                response = await router._client.post(
                    b.url + self.path, data=self.body, headers=headers
                )
            except aiohttp.ClientConnectorError as e:
                running.discard(task)  # not cancelled with the others it held
                b.mark_down()
                router._went_down(b, f"connection refused ({e})")
                router.breaker_failure(b)
                message = f"replica {b.replica_id} refused the connection"
                return _Failed(502, _error_body(message, 502), [])
            if response.status != 200:
                data = await response.content.read(_ERROR_BODY_LIMIT)
                if response.status in RETRY_STATUSES:
                    if response.status != 429:  # a full replica is not a broken one
                        router.breaker_failure(b)
                    passed = [
                        (k.encode(), v.encode())
                        for k, v in response.headers.items()
                        if k.lower() in ("content-type", "retry-after")
                    ]
                    return _Failed(response.status, data, passed)
                router.breaker_success(b)  # the replica works: the request is the client's
                router.metrics.requests.labels("invalid").inc()
                kind = response.headers.get("content-type", "application/json").encode()
                await _raw(self.send, response.status, data, kind)
                return None
            self.replica_headers = _replica_headers(b, response)
            if self.routing.stream:
                return await self._stream(b, view, response)
            data = await response.read()
            router.breaker_success(b)
            view.on_first_token(rid)
            router._distribute()
            self._release()
            kind = response.headers.get("content-type", "application/json").encode()
            await _raw(self.send, 200, data, kind, self._answer_headers())
            router.metrics.requests.labels("ok").inc()
            return None
        except asyncio.CancelledError as e:
            if not self._replica_down(e):
                raise
            return self._cut(b, "the replica went out")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return self._cut(b, f"the connection to the replica failed ({type(e).__name__})")
        finally:
            running.discard(task)
            router._drained(b)
            view.on_end(rid)
            router._distribute()
            if response is not None:
                # an answer read to its end leaves its connection to the pool; one cut short
                # (the client left, the replica failed) closes it: the replica aborts then
                if response.content.at_eof():
                    response.release()
                else:
                    response.close()

    def _replica_down(self, e: asyncio.CancelledError) -> bool:
        """Whether `e` is `_went_down`'s, and not the client's: then it is taken back, so
        that the request goes on (elsewhere, or to its error event)."""
        if self.client_gone or not e.args or e.args[0] != _REPLICA_DOWN:
            return False
        asyncio.current_task().uncancel()
        return True

    def _cut(self, b: Backend, why: str) -> _Failed | None:
        self.router.breaker_failure(b)
        if not self.sent:
            return _Failed(502, _error_body(f"replica {b.replica_id}: {why}", 502), [])
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
                    if not _has_token(held):
                        continue
                    view.on_first_token(rid)
                    ttft = router.clock() - self.routing.request.arrival_s
                    if self.predicted_ttft_s is not None:
                        router.on_predicted_first_token(ttft - self.predicted_ttft_s)
                    router._distribute()
                    router.breaker_success(b)
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
            router.breaker_success(b)
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


def _base_url(url: str) -> str:
    """A replica's URL as the router keeps it: no trailing slash, no /v1."""
    return url.rstrip("/").removesuffix("/v1")


def _unauthorized() -> RequestError:
    return RequestError(
        "invalid or missing API key (Authorization: Bearer KEY)", None, 401, "authentication_error"
    )


_OWN_HEADERS = (b"x-medha-replica", b"x-medha-predicted-ttft-ms")
_MAX_PASSED_HEADERS = 16


def _replica_headers(b: Backend, response: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
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


def _has_token(held: bytearray) -> bool:
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


def _capacity_tokens(metrics_text: str) -> int | None:
    """A replica's KV capacity in tokens from its /metrics: medha serve's gauge, or vLLM's
    cache_config_info (num_gpu_blocks x block_size)."""
    for line in metrics_text.splitlines():
        if line.startswith("medha_kv_capacity_tokens "):
            return int(float(line.split()[1]))
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(
                kv.split("=", 1)
                for kv in line[line.index("{") + 1 : line.index("}")].split(",")
                if "=" in kv
            )
            try:
                blocks = int(labels["num_gpu_blocks"].strip('"'))
                return blocks * int(labels["block_size"].strip('"'))
            except (KeyError, ValueError):
                return None
    return None


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _error_body(message: str, code: int) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ).encode()


async def _raw(
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


async def _json(send, status: int, obj) -> None:
    await _raw(send, status, json.dumps(obj, ensure_ascii=True, allow_nan=False).encode())


async def _error(send, error: RequestError, retry_after: bool = False) -> None:
    headers = [(b"retry-after", b"1")] if retry_after else []
    body = json.dumps(error.body(), ensure_ascii=True).encode()
    await _raw(send, error.status, body, b"application/json", headers)
