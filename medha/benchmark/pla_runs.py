"""A run of bench/paper/sim_pla_serve.py: one configuration (policy, cost model, dispatcher) on the
simulator's H200 prefill instances, SGLang's 8,192-token chunks unless it says otherwise, and
the metrics every figure and table reads off the result (throughput, mean and P90 TTFT, SLO
violations, batch depth, makespan, prefix hits).
"""

from __future__ import annotations

import math
import statistics

from medha.benchmark.harness import percentile
from medha.benchmark.pla_workload import SLO_S
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.simulator import ClusterConfig, Simulator

CHUNK = "static:8192"


def simulate(
    model, replicas, policy, predictor, dispatcher, reqs, on_finish=None, cluster=None, **sched
):
    """`reqs` (with `on_finish`, a closed loop's next requests) on `replicas` H200 prefill
    instances of `model`; `sched`: the scheduler's flat settings; `cluster`: the cluster's flat
    settings beyond these (the pla dispatcher's)."""
    cluster = ClusterConfig.from_flat(
        model=model,
        hardware="h200",
        predictor=predictor,
        replicas=replicas,
        dispatcher=dispatcher,
        **(cluster or {}),
    )
    sched.setdefault("chunking", CHUNK)
    config = SchedulerConfig.from_flat(
        policy=policy, prefix_cache="device" if replicas == 1 else "off", **sched
    )
    return Simulator(cluster, ParallelConfig(), config).run(reqs, on_finish=on_finish)


def metrics(result) -> dict:
    """What the figures and tables read off a run (every request with a first token)."""
    rs = [r for r in result.requests if r.ttft_s is not None]
    ttft = [r.ttft_s for r in rs]
    span = max(r.finish_s for r in rs) - min(r.arrival_s for r in rs)
    awd = [d for rep in result.dispatcher.replicas for d in _dispatches(rep)]
    return {
        "n": len(rs),
        "rps": len(rs) / span,
        "mean": statistics.mean(ttft),
        "p90": percentile(ttft, 90),
        "viol": sum(t > SLO_S for t in ttft) / len(ttft),
        "span": span,
        "depth": statistics.mean(d.depth for d in awd) if awd else float("nan"),
        "moves": len(getattr(result.dispatcher, "moves", ())),
        "hit": sum(r.num_cached_tokens for r in rs) / max(1, sum(r.prompt_len for r in rs)),
        # short prefills: fewer than 256 new tokens (the paper's largest captured length)
        "short_mean": statistics.mean(
            [r.ttft_s for r in rs if r.prompt_len - r.num_cached_tokens < 256] or [math.nan]
        ),
    }


def _dispatches(replica):
    awd = getattr(replica.scheduler.policy, "awd", None)
    return awd.dispatches if awd else ()
