"""Deferred prefill simulated: the real scheduler (deferred policy, whole prefills) under a
backlog that never runs dry, throughput measured while it lasts.

Every request is queued at t=0, so the batch is full from the first iteration; geometric
outputs are memoryless, so the run is in its steady state as soon as the KV lengths are (after
the first 2C departures, which we skip). The window ends when the last request is admitted.

Throughput is reported in requests/s as output tokens per second / mean output: the same
quantity as departures per second in steady state, with far less noise (the departures in a
window fluctuate like a Poisson count, about 1.4% for 5,000 of them, while the tokens per
second of a full batch barely move), and the curve is flat near its top.

Completion times are the paper's (section 4.1): from a request's admission (its prefill's
start; the time it waited in the backlog is left out, as the backlog is endless) to its last
token, in seconds, and normalized, divided by its output tokens. They are taken over the
requests admitted in the first half of the window: those all finish before the window ends
(a geometric output with mean 201 outlives half a window of thousands of steps with
negligible probability), so none is cut short and none finishes in the drained batch after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from medha.analysis.deferred_prefill import DeferredSystem
from medha.core.config import DeferredSettings, SchedulerConfig
from medha.perf import ParallelConfig, Predictor
from medha.sim.simulator import ClusterConfig, SimResult, Simulator
from medha.sim.workload.generator import WorkloadConfig, build_requests


@dataclass(frozen=True)
class SimPoint:
    k: int
    requests_per_s: float  # output tokens/s / mean output
    departures_per_s: float  # finished requests / window (noisier)
    mean_group: float  # prompts per prefilling iteration (E[D] of the model)
    mean_completion_s: float = float("nan")  # admission to last token
    mean_normalized_s: float = float("nan")  # completion / output tokens, mean over requests
    p95_normalized_s: float = float("nan")  # ... and its 95th percentile


def scheduler_config(system: DeferredSystem, k: int) -> SchedulerConfig:
    return SchedulerConfig(
        policy="deferred",
        chunking="none",
        deferred=DeferredSettings(departure_threshold=k, batch_cap=system.cap),
        max_num_seqs=system.cap,
        prefill_only_iterations=system.prefill_only,
    )


def saturated_workload(system: DeferredSystem, num_requests: int, seed: int) -> WorkloadConfig:
    if num_requests < 4 * system.cap:
        raise ValueError(
            f"num_requests must be at least 4 C = {4 * system.cap} (2 C are "
            f"warm-up), got {num_requests}"
        )
    # qps so high that every request is queued within microseconds of t=0
    return WorkloadConfig(
        trace="synthetic",
        prompt_len=system.prompt_tokens,
        output_len=round(system.mean_output),
        output_distribution="geometric",
        qps=1e9,
        num_requests=num_requests,
        seed=seed,
    )


def simulate_point(
    system: DeferredSystem,
    k: int,
    cluster: ClusterConfig,
    parallel: ParallelConfig,
    predictor: Predictor,
    num_requests: int,
    seed: int = 0,
) -> SimPoint:
    sim = Simulator(cluster, parallel, scheduler_config(system, k), predictor=predictor)
    requests = build_requests(saturated_workload(system, num_requests, seed), sim.max_model_len)
    result = sim.run(requests)
    return SimPoint(
        k, *saturated_throughput(result, system), *completion_times(result, *window(result, system))
    )


def window(result: SimResult, system: DeferredSystem) -> tuple[float, float]:
    """(the 2C-th departure, the last admission): the steady state of a full batch."""
    finishes = sorted(r.finish_s for r in result.requests)
    start = finishes[2 * system.cap]
    end = max(r.first_scheduled_s for r in result.requests)
    if end <= start:
        raise ValueError("the backlog ran dry during warm-up: simulate more requests")
    return start, end


def completion_times(result: SimResult, start: float, end: float) -> tuple[float, float, float]:
    """(mean completion s, mean and 95th percentile of completion s per output token) of the
    requests admitted in the window's first half."""
    import numpy as np

    half = (start + end) / 2
    done = [
        r
        for r in result.requests
        if start <= r.first_scheduled_s < half and r.finish_s is not None and r.finish_s <= end
    ]
    if not done:
        raise ValueError("no request was admitted and finished inside the window")
    spans = np.array([r.finish_s - r.first_scheduled_s for r in done])
    normalized = spans / np.array([r.max_tokens for r in done], float)
    return float(spans.mean()), float(normalized.mean()), float(np.percentile(normalized, 95))


def saturated_throughput(result: SimResult, system: DeferredSystem) -> tuple[float, float, float]:
    """(requests/s from output tokens, departures/s, prompts per prefilling iteration)
    between the 2C-th departure and the last admission."""
    finishes = sorted(r.finish_s for r in result.requests)
    start, end = window(result, system)
    log = result.log
    rows = [
        (s, e, d, p)
        for s, e, d, p in zip(log.start_s, log.end_s, log.num_decodes, log.num_prefills)
        if s >= start and e <= end
    ]
    tokens = sum(d + p for _, _, d, p in rows)
    span = rows[-1][1] - rows[0][0]
    departures = sum(start < f <= end for f in finishes)
    groups = [p for *_, p in rows if p]
    return (
        tokens / span / system.mean_output,
        departures / (end - start),
        sum(groups) / max(1, len(groups)),
    )
