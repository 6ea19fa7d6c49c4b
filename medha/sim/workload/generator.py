"""Request lists for the simulator: a trace replayed, or lengths with generated arrivals, and the
long-context mixture of the Medha evaluation."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from medha.core.request import PRIORITY_CLASSES, Request
from medha.sim.workload.traces import TraceEntry, TraceError, load_trace

# The Medha-SWE long-context set: prefill P50 393K, P90 839K, within 128K..1M tokens;
# decode P50 518, P90 808 tokens.
LONG_PREFILL = dict(p50=393_000, p90=839_000, low=128 * 1024, high=1 << 20)
LONG_DECODE = dict(p50=518, p90=808, low=1, high=1 << 14)
# (mu, sigma) of the log-normals that, truncated to [low, high], have those P50 and P90: solved
# once with scipy (tests/test_workload.py solves them again and compares) and kept, because
# importing scipy would cost every `medha simulate` seconds of start-up.
LONG_PREFILL_LOGNORMAL = (13.00428080652011, 1.1774316300736176)
LONG_DECODE_LOGNORMAL = (6.249975242259483, 0.34691293501805504)


@dataclass
class WorkloadConfig:
    trace: str = field(
        default="sharegpt",
        metadata={
            "help": (
                "bundled trace (sharegpt, arxiv, splitwise_conv, splitwise_code, azure_conv, "
                "azure_code, mooncake_conv: with prefix hash ids), a CSV/JSONL file, or "
                "'synthetic' (every request --prompt-len and --output-len tokens)"
            )
        },
    )
    num_requests: int | None = field(
        default=None,
        metadata={
            "help": (
                "requests to simulate (default: every row of a timestamped trace, 1000 otherwise)"
            )
        },
    )
    qps: float | None = field(
        default=None,
        metadata={
            "help": (
                "arrival rate in requests/s; required for traces without timestamps, and replaces "
                "a trace's own timestamps when given"
            )
        },
    )
    arrival: str = field(
        default="poisson",
        metadata={"help": ("generated arrivals: poisson, or gamma (burstier, see --gamma-cv)")},
    )
    gamma_cv: float = field(
        default=2.0, metadata={"help": ("coefficient of variation of gamma inter-arrival times")}
    )
    time_scale: float = field(
        default=1.0,
        metadata={"help": ("multiply a trace's timestamps (0.5 replays it twice as fast)")},
    )
    long_fraction: float = field(
        default=0.0,
        metadata={
            "help": (
                "fraction of requests replaced by long-context ones drawn like Medha-SWE (prefill "
                "P50 393K, P90 839K tokens, 128K-1M; decode P50 518, P90 808)"
            )
        },
    )
    long_scale: float = field(
        default=1.0,
        metadata={
            "help": (
                "multiply the long requests' prompt lengths (the Medha paper's 70B runs scale "
                "Medha-SWE to 2M-token prompts: 2); the model context must hold them"
            )
        },
    )
    prompt_len: int = field(default=512, metadata={"help": "prompt tokens for --trace synthetic"})
    output_len: int = field(
        default=128,
        metadata={
            "help": (
                "output tokens for --trace synthetic (the mean with --output-distribution "
                "geometric)"
            )
        },
    )
    output_distribution: str = field(
        default="fixed",
        metadata={
            "help": (
                "output lengths for --trace synthetic: fixed (every request --output-len tokens) "
                "or geometric (each token ends its request with probability 1/--output-len, the "
                "deferred-prefill paper's model)"
            )
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for sampling and arrivals"})
    priority_mix: str | None = field(
        default=None,
        metadata={
            "help": (
                "priority classes drawn per request, as CLASS:SHARE,... over REALTIME, HIGH, "
                "NORMAL, LOW (e.g. REALTIME:0.1,NORMAL:0.6,LOW:0.3; shares are normalized); the "
                "lengths and arrivals stay those of the same seed without it (default: every "
                "request NORMAL)"
            )
        },
    )

    def __post_init__(self) -> None:
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival must be poisson or gamma, got {self.arrival!r}")
        if self.output_distribution not in ("fixed", "geometric"):
            raise ValueError(
                f"output_distribution must be fixed or geometric, got {self.output_distribution!r}"
            )
        checks = [
            ("qps", self.qps, False),
            ("gamma_cv", self.gamma_cv, False),
            ("time_scale", self.time_scale, False),
            ("long_scale", self.long_scale, False),
        ]
        for name, value, _ in checks:
            if value is not None and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction must lie in [0, 1], got {self.long_fraction!r}")
        for name in ("num_requests", "prompt_len", "output_len"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.priority_mix is not None:
            parse_priority_mix(self.priority_mix)


def parse_priority_mix(text: str) -> dict[str, float]:
    """'REALTIME:0.1,LOW:0.9' -> {class: share}, shares normalized to sum to 1."""
    shares: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition(":")
        name = name.strip().upper()
        if not sep or name not in PRIORITY_CLASSES:
            raise ValueError(
                f"priority_mix: {part!r} is not CLASS:SHARE with CLASS one of "
                f"{', '.join(PRIORITY_CLASSES)}"
            )
        try:
            share = float(value)
        except ValueError:
            raise ValueError(f"priority_mix: share {value!r} of {name} is not a number") from None
        if not (math.isfinite(share) and share >= 0) or name in shares:
            raise ValueError(f"priority_mix: {name} needs one share >= 0, got {part!r}")
        shares[name] = share
    total = sum(shares.values())
    if total <= 0:
        raise ValueError(f"priority_mix {text!r}: the shares add up to nothing")
    return {name: share / total for name, share in shares.items()}


def _assign_classes(requests: list[Request], mix: str, seed: int) -> None:
    # a generator of its own, so that the lengths and arrivals stay those of the seed
    rng = random.Random(f"priority-{seed}")
    shares = parse_priority_mix(mix)
    names, weights = list(shares), list(shares.values())
    for r in requests:
        r.priority_class = rng.choices(names, weights)[0]


def sample_long(rng: random.Random, max_context: int, scale: float = 1.0) -> tuple[int, int]:
    """One long-context request, (prompt tokens, output tokens), drawn like Medha-SWE, its
    prompt `scale` times as long (the draws, and so every other request, stay the same)."""
    (pm, ps), (dm, ds) = LONG_PREFILL_LOGNORMAL, LONG_DECODE_LOGNORMAL

    def draw(mu, s, low, high):
        while True:
            x = rng.lognormvariate(mu, s)
            if low <= x <= high:
                return int(x)

    output = draw(dm, ds, LONG_DECODE["low"], LONG_DECODE["high"])
    prompt = int(draw(pm, ps, LONG_PREFILL["low"], LONG_PREFILL["high"]) * scale)
    return min(prompt, max_context - output), output


def sample_geometric(rng: random.Random, mean: float, limit: int) -> int:
    """Tokens until a stop that comes with probability 1/mean after each one (at least 1,
    at most `limit`): P(n) = (1 - p)^(n-1) p, by inversion."""
    if mean <= 1:
        return 1
    n = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean))
    return min(n, limit)


def _arrivals(cfg: WorkloadConfig, n: int, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    if cfg.arrival == "poisson":
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(cfg.qps)
    else:
        shape = 1.0 / cfg.gamma_cv**2
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(shape, 1.0 / (cfg.qps * shape))
    return out


def build_requests(cfg: WorkloadConfig, max_context: int) -> list[Request]:
    """The request list of a run; the same config and seed always give the same list."""
    rng = random.Random(cfg.seed)
    if cfg.trace == "synthetic":
        n = cfg.num_requests or 1000
        entries = [TraceEntry(None, cfg.prompt_len, cfg.output_len)] * n
        if cfg.output_distribution == "geometric":
            limit = max(1, max_context - cfg.prompt_len)
            entries = [
                TraceEntry(None, cfg.prompt_len, sample_geometric(rng, cfg.output_len, limit))
                for _ in range(n)
            ]
    else:
        timed_limit = cfg.num_requests if cfg.qps is None else None
        entries = load_trace(cfg.trace, limit=timed_limit)
        timed = entries[0].arrival_s is not None and cfg.qps is None
        n = cfg.num_requests or (len(entries) if timed else 1000)
        if not timed:
            # lengths only: draw rows in a seeded order, cycling if more requests are needed
            order = list(range(len(entries)))
            rng.shuffle(order)
            entries = [
                dataclasses.replace(entries[order[i % len(order)]], arrival_s=None)
                for i in range(n)
            ]
    timed = entries[0].arrival_s is not None
    if not timed and cfg.qps is None:
        raise TraceError(f"trace {cfg.trace} has no timestamps: give --qps")
    arrivals = (
        [e.arrival_s * cfg.time_scale for e in entries]
        if timed
        else _arrivals(cfg, len(entries), rng)
    )
    requests = []
    for i, (e, at) in enumerate(zip(entries, arrivals)):
        prompt, output, hashes, tokens = e.prompt_len, e.output_len, e.hash_ids, e.token_ids
        if cfg.long_fraction and rng.random() < cfg.long_fraction:
            prompt, output = sample_long(rng, max_context, cfg.long_scale)
            hashes = tokens = None
        if prompt + output > max_context:
            raise TraceError(
                f"request {i} of {cfg.trace}: {prompt} prompt + {output} output "
                f"tokens exceed the model context of {max_context}"
            )
        requests.append(
            Request(
                f"r{i}",
                at,
                prompt,
                output,
                prompt_token_ids=None if tokens is None else list(tokens),
                prefix_hash_ids=None if hashes is None else list(hashes),
            )
        )
    if cfg.priority_mix:
        _assign_classes(requests, cfg.priority_mix, cfg.seed)
    return requests
