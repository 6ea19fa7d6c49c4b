"""Prometheus metrics of one server (its own registry, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from medha.engine.llm_engine import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


# Gauges read from the engine's stats when scraped: (name, help, EngineStats field).
_STATS_GAUGES = (
    (
        "medha_num_requests_waiting",
        "Requests whose prefill has not started (new, or preempted by recompute)",
        "waiting",
    ),
    (
        "medha_num_requests_prefilling",
        "Requests whose prefill has started and not finished",
        "prefilling",
    ),
    ("medha_num_requests_running", "Requests decoding", "running"),
    ("medha_kv_blocks_used", "KV cache blocks in use", "kv_blocks_used"),
    ("medha_preemptions", "Preemptions (recompute and swap) since start", "preemptions"),
    (
        "medha_prefix_cache_queries_tokens",
        "Prompt tokens looked up in the prefix cache since start (each prefill started)",
        "prefix_query_tokens",
    ),
    (
        "medha_prefix_cache_hits_tokens",
        "Prompt tokens the prefix cache supplied since start: prefill tokens saved",
        "prefix_hit_tokens",
    ),
    (
        "medha_prefix_cache_host_hits_tokens",
        "Of the prefix cache's hits, tokens copied back from its host-memory tier",
        "prefix_host_hit_tokens",
    ),
)


class ServerMetrics:
    def __init__(
        self, kv_blocks_total: int, stats: Callable[[], EngineStats], kv_capacity_tokens: int = 0
    ) -> None:
        """`stats`: the engine's, which the gauges read at scrape time (on the HTTP thread)."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "medha_requests",
            "Requests by final status: ok (stop or length), aborted (client "
            "gone or shutdown), rejected (queue full), invalid (4xx), failed (engine error)",
            ["status"],
            registry=r,
        )
        self.ttft = Histogram(
            "medha_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "medha_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "medha_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.iteration = Histogram(
            "medha_iteration_seconds",
            "Time of one engine iteration",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "medha_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "medha_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        for name, doc, field in _STATS_GAUGES:
            Gauge(name, doc, registry=r).set_function(lambda field=field: getattr(stats(), field))
        Gauge("medha_kv_blocks_total", "KV cache blocks", registry=r).set(kv_blocks_total)
        # what a router in front takes this replica's prefix cache to hold at most
        Gauge("medha_kv_capacity_tokens", "Tokens the KV cache holds", registry=r).set(
            kv_capacity_tokens
        )
        Gauge(
            "medha_prefix_cache_hit_rate",
            "Prefix cache hits over lookups, in tokens, since start (0 before any lookup)",
            registry=r,
        ).set_function(lambda: (s := stats()).prefix_hit_tokens / max(1, s.prefix_query_tokens))
        for status in ("ok", "aborted", "rejected", "invalid", "failed"):
            self.requests.labels(status)  # export zeros from the start

    def finished(self, out) -> None:
        m = out.metrics
        self.requests.labels("ok").inc()
        self.ttft.observe(m["ttft_s"])
        if m["tpot_s"] is not None:
            self.tpot.observe(m["tpot_s"])
        self.e2e.observe(m["e2e_s"])
        self.prompt_tokens.inc(m["prompt_tokens"])
        self.generation_tokens.inc(m["completion_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
