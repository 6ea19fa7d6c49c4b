"""The router's Prometheus metrics (its own registry, so tests can run several routers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from medha.route.tracked import TrackedReplica

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


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

    def scrape(self, tracked: list[TrackedReplica], prediction_error_s: float) -> bytes:
        """GET /metrics: the gauges read from the replicas' views when scraped, then all."""
        for t in tracked:
            self.live.labels(str(t.replica_id)).set(t.num_live)
            self.slowdown.labels(str(t.replica_id)).set(t.slowdown)
        self.prediction_error.set(prediction_error_s)
        return generate_latest(self.registry)
