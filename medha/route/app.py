"""`medha route`'s proxy: an ASGI app (no framework on the request path: its cost is the router's
overhead) in front of OpenAI-compatible replicas. Here the `Router`, which wires the parts and
answers HTTP: /health, /metrics, /v1/models, the generation paths, and /replicas (admin.py).

A generation request is read once for routing (medha/route/prompt.py), given to the dispatcher
(the class `medha simulate` runs, over the router's TrackedReplica models; placement.py), and its
body sent to the replica unchanged (exchange.py). The parts, one module each:

- the replica set (replicas.py): membership, health checks, what is learned from each replica;
  the models it is priced with (pricing.py). A replica is out after `unhealthy_after` failed
  health checks, or at once when it refuses a connection; back after `healthy_after` passed
  ones. Requests it holds are cut when it goes out, so a replica that hangs cannot hold a
  stream open. A replica's circuit breaker (backend.py) opens after `breaker_failures` failed
  requests in a row and lets one trial request through after `breaker_open_s`.
- the exchange with a replica (exchange.py): a request that has streamed nothing to its client
  is tried again on another replica (each replica once, `max_attempts` in all) after a refused
  or cut connection or a 429/5xx answer. A stream is held back until its first token (the
  role-only chunk a chat stream opens with included), so "nothing sent" is exact. A stream cut
  after its first token ends with an error event (`data: {"error": ...}`) and `data: [DONE]`:
  the client learns it at once and never hangs. A client that disconnects cancels its request,
  which closes the connection to the replica (medha serve aborts the request then).
- admission (admission.py): body limits as `medha serve` (413 before reading; 429 past the
  bytes of all bodies the router holds, which it holds until a request's first token, for its
  retries), and past `max_waiting` requests waiting for their first token, `max_concurrent`
  open ones or the `rate_limit_rps` token bucket a request queues, in arrival order; 429 with
  Retry-After past `queue_size` queued, 408 after `queue_timeout_s`.
- the metrics (metrics.py) and the HTTP helpers (http_helpers.py).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable

import aiohttp

from medha.route.admin import admin
from medha.route.admission import Admission, RateBucket, body_limits
from medha.route.config import RouteConfig
from medha.route.exchange import Exchange
from medha.route.http_helpers import read_body, send_error, send_json, send_raw, unauthorized
from medha.route.metrics import RouterMetrics
from medha.route.placement import Placement
from medha.route.pricing import Pricing, auto_predictor, published_scheduler
from medha.route.prompt import TokenCache, load_tokenizer, prompt_pieces, read_request
from medha.route.replicas import ReplicaSet, replica_api_keys
from medha.server.body_guard import BodyGuard
from medha.server.errors import RequestError

# (imported from here by the CLI and tests)
__all__ = ["RateBucket", "Router", "RouterMetrics", "auto_predictor", "published_scheduler"]

log = logging.getLogger("medha.route")

GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
DEFAULT_OUTPUT_TOKENS = 128  # a request without max_tokens: a typical answer's length


class Router:
    """The parts, wired: the replica set, the models it is priced with, the placement of
    requests over it, admission, the metrics; and the ASGI app over them."""

    def __init__(
        self,
        config: RouteConfig,
        urls: list[str],
        replica_keys: list[str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        keys, default_key = replica_api_keys(config, urls, replica_keys)
        self.config, self.clock = config, clock
        self.pricing = Pricing(config)
        self.metrics = RouterMetrics()
        self.metrics.context.set(self.pricing.context)
        self.replicas = ReplicaSet(
            config, self.pricing, self.metrics, urls, keys, default_key, clock
        )
        self.placement = Placement(config, self.replicas, self.pricing.scheduler_config, clock)
        self.replicas.on_change = self.placement.renew
        self.replicas.on_ready = self.placement.distribute
        self.tokens = TokenCache(load_tokenizer(config.tokenizer))
        self.max_request_bytes, self.max_held_bytes = body_limits(
            config, self.pricing.scheduler_config.max_model_len
        )
        self.admission = Admission(config, self.metrics, self.max_held_bytes, clock)
        self.client: aiohttp.ClientSession | None = None  # (from start())
        self._api_key = config.api_key.encode() if config.api_key else None

    # ---- life --------------------------------------------------------------------------------
    async def start(self) -> None:
        # aiohttp, not httpx: forwarding one request costs 0.8 ms of CPU with it against 2 ms
        # (measured on this 2-core machine; docs/route.md), and that is the router's overhead
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,
        )
        await self.replicas.start(self.client)
        self.placement.start()

    async def stop(self) -> None:
        self.replicas.stop()
        self.placement.stop()
        if self.client is not None:
            await self.client.close()

    def asgi(self):
        """The app: this router behind the body guard."""
        return BodyGuard(self, self.max_request_bytes, self.max_held_bytes, "medha route")

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

    # ---- what the parts use ------------------------------------------------------------------
    @property
    def has_api_key(self) -> bool:
        """Whether clients must give the router's API key (and /replicas is served)."""
        return self._api_key is not None

    def authorized(self, scope) -> bool:
        if self._api_key is None:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return secrets.compare_digest(given, b"Bearer " + self._api_key)

    # ---- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        if kind != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method in ("GET", "HEAD"):
            members = self.replicas.members()
            n = sum(b.up for b in members)
            status = 200 if n else 503
            body = {"healthy_replicas": n, "replicas": len(members)}
            return await send_json(send, status, body)
        if path == "/metrics" and method == "GET":
            text = self.metrics.scrape(self.replicas.tracked, self.placement.prediction_error_s())
            return await send_raw(send, 200, text, b"text/plain")
        if path == "/replicas" or path.startswith("/replicas/"):
            return await admin(self, scope, receive, send)
        if path in GENERATION_PATHS or path == "/v1/models":
            if not self.authorized(scope):
                return await send_error(send, unauthorized())
            if path == "/v1/models" and method == "GET":
                return await send_json(send, 200, {"object": "list", "data": self._models()})
            if method == "POST" and path in GENERATION_PATHS:
                return await self._generate(scope, receive, send, GENERATION_PATHS[path])
            return await send_error(send, RequestError("method not allowed", None, 405))
        return await send_error(
            send, RequestError(f"no route {path}", None, 404, "not_found_error")
        )

    def _models(self) -> list[dict]:
        seen: dict[str, dict] = {}
        for b in self.replicas.backends:
            if b.up:
                for m in b.models:
                    seen.setdefault(m["id"], m)
        return list(seen.values())

    # ---- generation --------------------------------------------------------------------------
    async def _generate(self, scope, receive, send, chat: bool) -> None:
        body = await read_body(receive)
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            payload = None
        if not isinstance(payload, dict):
            self.metrics.requests.labels("invalid").inc()
            return await send_error(send, RequestError("the request body must be a JSON object"))
        if not self.replicas.tracked:  # (started with none, none added yet)
            self.metrics.requests.labels("failed").inc()
            return await send_error(
                send,
                RequestError(
                    "the router has no replicas yet (POST /replicas adds one)",
                    None,
                    503,
                    "server_error",
                ),
                retry_after=True,
            )
        if await self.admission.body_refused(send, len(body)):
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        now = self.clock()  # its arrival: tokenizing is part of its wait
        try:
            tokens = await self.tokens.tokens(prompt_pieces(payload, chat))
            routing = read_request(
                payload, tokens, uuid.uuid4().hex, now, headers, DEFAULT_OUTPUT_TOKENS
            )
            exchange = Exchange(self, scope, receive, send, body, routing, headers)
        except Exception:
            # a fault of the router's own (its estimates must never fail a request): the
            # request ends with an error that says so, counted, and the router goes on
            log.exception("the router could not route a request")
            self.metrics.requests.labels("failed").inc()
            return await send_error(
                send,
                RequestError(
                    "the router failed to route this request (a fault of the router's; its "
                    "log has the details)",
                    None,
                    500,
                    "server_error",
                ),
            )
        if not await self.admission.admitted(send, len(body)):
            return
        await exchange.run()
