"""What `medha bench` sends: lengths from a trace or a workload spec, Poisson arrivals."""

from __future__ import annotations

import random
from dataclasses import dataclass

from medha.sim.workload.traces import TraceError, load_trace

WORKLOAD_HELP = (
    "comma-separated key=value: prompt=LO-HI, output=LO-HI (tokens, uniform), and optionally "
    "long_fraction=F with long_prompt=LO-HI, long_output=LO-HI; e.g. "
    "'prompt=32-256,output=16-64,long_fraction=0.05,long_prompt=3000-6000' "
    "(default: prompt=32-256,output=32-128)"
)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float
    prompt_len: int
    output_len: int


def _range(key: str, value: str) -> tuple[int, int]:
    try:
        lo, _, hi = value.partition("-")
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--workload {key}={value!r}: expected LO-HI token counts") from None
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"--workload {key}={value!r}: need 1 <= LO <= HI")
    return lo_i, hi_i


def parse_workload(spec: str) -> dict:
    out = {
        "prompt": (32, 256),
        "output": (32, 128),
        "long_fraction": 0.0,
        "long_prompt": (3000, 6000),
        "long_output": None,
    }
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in out:
            raise ValueError(f"--workload: unknown item {item!r}; keys are {', '.join(out)}")
        if key == "long_fraction":
            try:
                out[key] = float(value)
            except ValueError:
                raise ValueError(f"--workload long_fraction={value!r} is not a number") from None
            if not 0 <= out[key] <= 1:
                raise ValueError(f"--workload long_fraction={value} must lie in [0, 1]")
        else:
            out[key] = _range(key, value)
    out["long_output"] = out["long_output"] or out["output"]
    return out


def build_requests(
    *, trace: str | None, workload: str | None, qps: float | None, num_requests: int, seed: int
) -> list[BenchRequest]:
    """The same arguments always give the same list (lengths and arrival times)."""
    rng = random.Random(seed)
    if trace:
        entries = load_trace(trace)
        timed = entries[0].arrival_s is not None and qps is None
        if not timed and qps is None:
            raise TraceError(f"trace {trace} has no timestamps: give --qps")
        entries = (
            entries[:num_requests]
            if timed
            else [entries[rng.randrange(len(entries))] for _ in range(num_requests)]
        )
        lengths = [(e.prompt_len, e.output_len) for e in entries]
        arrivals = [e.arrival_s - entries[0].arrival_s for e in entries] if timed else None
    else:
        w = parse_workload(workload or "")
        lengths = []
        for _ in range(num_requests):
            long = rng.random() < w["long_fraction"]
            p, o = (w["long_prompt"], w["long_output"]) if long else (w["prompt"], w["output"])
            lengths.append((rng.randint(*p), rng.randint(*o)))
        arrivals = None
    if arrivals is None:
        if qps is None:
            raise ValueError("--qps is required with --workload")
        t, arrivals = 0.0, []
        for _ in lengths:
            arrivals.append(t)
            t += rng.expovariate(qps)
    return [BenchRequest(i, a, p, o) for i, (a, (p, o)) in enumerate(zip(arrivals, lengths))]
