"""The router's settings (`medha route` flags). Nothing here imports the router, the scheduler or
numpy: the CLI builds its parser from RouteConfig alone."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha.dispatch.config import DISPATCHER_NAMES
from medha.utils.registry import unknown_name

ROUTE_DEFAULT_DISPATCHER = "slack"


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class RouteConfig:
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=8080, metadata=_help("TCP port (0: any free port)"))
    dispatcher: str = field(
        default=ROUTE_DEFAULT_DISPATCHER,
        metadata=_help(
            "which replica takes a request, the same classes as `medha simulate "
            "--dispatcher`: slack (default: the replica that keeps the smallest relative TTFT "
            "slack of all waiting requests highest, from each replica's predicted queue and "
            "cache), prefix (longest cached prefix among replicas within one least TTFT "
            "deadline of the least loaded), least_work, round_robin, pla (PLA-Serve's "
            "short/long pools)",
            choices=DISPATCHER_NAMES,
        ),
    )
    api_key: str | None = field(
        default=None,
        metadata=_help(
            "require `Authorization: Bearer KEY` on /v1 (default: $MEDHA_API_KEY if set); "
            "compared in constant time, never logged"
        ),
    )
    # --- what the router knows of its replicas, for its predictions ---------------------------
    model: str = field(
        default="smollm2-135m-instruct",
        metadata=_help(
            "model spec of the replicas, for predicting their prefill and decode times until "
            "a replica publishes its own batch-time model (medha serve does: GET "
            "/medha/predictor, read at its first health check and every 20 after)"
        ),
    )
    hardware: str = field(
        default="cpu", metadata=_help("the replicas' device: cpu, a100, h100 or h200")
    )
    predictor: str = field(
        default="auto",
        metadata=_help(
            "the replicas' batch-time model until a replica publishes its own (as --model): "
            "auto (the profile `medha profile` wrote for --model on this machine, else "
            "roofline), roofline, profiled:PATH, ..."
        ),
    )
    policy: str | None = field(
        default=None,
        metadata=_help(
            "the replicas' scheduling policy, for the order the slack dispatcher predicts "
            "(default: medha serve's)"
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_help(
            "a tokenizer.json (or the directory holding one) for counting prompt tokens and "
            "keying their prefix blocks (default: the embedded model's, if converted; else "
            "4 characters count as a token)"
        ),
    )
    block_size: int = field(
        default=16, metadata=_help("tokens per prefix block the router keys prompts by")
    )
    replica_cache_tokens: int = field(
        default=0,
        metadata=_help(
            "prompt tokens each replica's prefix cache is taken to hold, LRU (0: its KV "
            "capacity from its /metrics, else 1M)"
        ),
    )
    # --- faults -------------------------------------------------------------------------------
    health_interval_s: float = field(
        default=0.5, metadata=_help("seconds between a replica's health checks")
    )
    health_timeout_s: float = field(
        default=1.0, metadata=_help("a health check not answered within this fails")
    )
    unhealthy_after: int = field(
        default=2,
        metadata=_help(
            "failed health checks in a row that take a replica out (a refused connection on a "
            "request takes it out at once)"
        ),
    )
    healthy_after: int = field(
        default=2, metadata=_help("passed health checks in a row that bring it back")
    )
    breaker_failures: int = field(
        default=5,
        metadata=_help("failed requests in a row that open a replica's circuit breaker"),
    )
    breaker_open_s: float = field(
        default=5.0,
        metadata=_help("seconds an open breaker refuses requests before one trial request"),
    )
    breaker_window_s: float = field(
        default=0.0,
        metadata=_help(
            "count a replica's failed requests toward --breaker-failures within this many "
            "seconds, successes between them or not (0: failures in a row only)"
        ),
    )
    breaker_successes: int = field(
        default=1,
        metadata=_help(
            "trial requests (one at a time) that must succeed to close a half-open breaker"
        ),
    )
    retry_backoff_s: float = field(
        default=0.05,
        metadata=_help(
            "before retrying on another replica, wait a random time of up to this x "
            "2^(retries so far), at most 2 s (full jitter: retries of many requests spread "
            "out); 0: retry at once"
        ),
    )
    max_attempts: int = field(
        default=3,
        metadata=_help(
            "replicas a request is tried on, each at most once, while it has streamed nothing"
        ),
    )
    connect_timeout_s: float = field(
        default=2.0, metadata=_help("seconds to connect to a replica before trying another")
    )
    # --- admission ----------------------------------------------------------------------------
    max_waiting: int = field(
        default=512,
        metadata=_help(
            "requests waiting for their first token, all replicas, before new ones get 429 "
            "with Retry-After"
        ),
    )
    max_concurrent: int = field(
        default=0,
        metadata=_help(
            "requests open through the router at once, waiting for their first token or "
            "streaming, all replicas (0: no cap); past it, or past --max-waiting, a request "
            "queues"
        ),
    )
    queue_size: int = field(
        default=256,
        metadata=_help(
            "requests that may queue, in arrival order, while the router is at --max-waiting "
            "or --max-concurrent; past it they get 429 with Retry-After (0: no queue, 429 at "
            "once)"
        ),
    )
    queue_timeout_s: float = field(
        default=60.0,
        metadata=_help("a request still queued after this many seconds gets 408"),
    )
    rate_limit_rps: float = field(
        default=0.0,
        metadata=_help(
            "requests admitted a second, all clients (a token bucket; 0: no limit); past it a "
            "request queues as at --max-concurrent (429 past --queue-size, 408 after "
            "--queue-timeout-s)"
        ),
    )
    rate_limit_burst: int = field(
        default=0,
        metadata=_help(
            "requests the bucket admits at once after a quiet spell (0: one second's worth, "
            "at least 1)"
        ),
    )
    max_request_bytes: int | None = field(
        default=None,
        metadata=_help(
            "request bodies above this size get 413 before they are read (default: 64 bytes "
            "per token of --model's context + 1 MiB, as medha serve)"
        ),
    )
    max_buffered_bytes: int | None = field(
        default=None,
        metadata=_help(
            "bytes of all request bodies in the router at once (received, or on their way to "
            "a replica); a body that would pass it gets 429 with Retry-After (default: 16 x the "
            "body limit)"
        ),
    )
    log_level: str = field(default="info", metadata=_help("log level"))

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHER_NAMES:
            raise unknown_name("dispatcher", self.dispatcher, DISPATCHER_NAMES)
        for name in ("health_interval_s", "health_timeout_s", "breaker_open_s", "queue_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if not (math.isfinite(self.connect_timeout_s) and self.connect_timeout_s > 0):
            raise ValueError(f"connect_timeout_s must be positive, got {self.connect_timeout_s}")
        for name in (
            "block_size",
            "unhealthy_after",
            "healthy_after",
            "breaker_failures",
            "max_attempts",
            "max_waiting",
            "breaker_successes",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("breaker_window_s", "retry_backoff_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {v!r}")
        v = self.rate_limit_rps
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
            raise ValueError(f"rate_limit_rps must be requests a second >= 0, got {v!r}")
        for name in ("max_concurrent", "queue_size", "rate_limit_burst"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.replica_cache_tokens < 0:
            raise ValueError(f"replica_cache_tokens must be >= 0, got {self.replica_cache_tokens}")
        for name in ("max_request_bytes", "max_buffered_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
