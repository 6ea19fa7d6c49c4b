"""Convoy effect (Medha Fig. 1, 9b): Llama-3-8B on 16 A100s, ShareGPT + 5% long requests.

    python bench/sim_convoy_effect.py [--qps 0.25 0.5 ... 1.75] [--num-requests 500]

medha (TP8 x SPP2, lars + adaptive chunking + multi-prefill) against the same 16 GPUs in the
same layout under non-preemptive FCFS and under Sarathi's static chunks of 512 and 2048, all on
the identical request list at each rate. Prints one markdown table per rate and the ratios.
"""

from __future__ import annotations

import argparse

from medha.core.config import SchedulerConfig
from medha.perf import ParallelConfig
from medha.sim.runner import RunSpec, compare_table, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

# name, policy, chunking, (tp, spp, replicas)
CONFIGS = [
    ("medha (lars, adaptive)", "lars", "adaptive", (8, 2, 1)),
    ("non-preemptive fcfs", "fcfs", "none", (8, 2, 1)),
    # a whole prompt is one batch, which SPP cannot overlap with anything: two TP8
    # replicas are the fairer layout for a system without chunking
    ("non-preemptive fcfs, 2 x TP8", "fcfs", "none", (8, 1, 2)),
    ("sarathi static:512", "fcfs", "static:512", (8, 2, 1)),
    ("sarathi static:2048", "fcfs", "static:2048", (8, 2, 1)),
]


def run(qps: float, n: int, seed: int):
    work = WorkloadConfig(trace="sharegpt", qps=qps, num_requests=n, long_fraction=0.05, seed=seed)
    outcomes = []
    for name, policy, chunking, (tp, spp, replicas) in CONFIGS:
        spec = RunSpec(
            name=name,
            cluster=ClusterConfig(model="llama-3-8b", hardware="a100", replicas=replicas),
            parallel=ParallelConfig(tp=tp, spp=spp),
            scheduler=SchedulerConfig(policy=policy, chunking=chunking),
        )
        outcomes.append(simulate(spec, work))
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ratios = []
    for qps in args.qps:
        outcomes = run(qps, args.num_requests, args.seed)
        print(f"\n### {qps} QPS ({args.num_requests} requests, seed {args.seed})\n")
        print(compare_table(outcomes)[0])
        medha = outcomes[0]
        # compare with the better of the two non-preemptive layouts, metric by metric
        m = medha.summary["by_class"]["short"]["ttft_s"]
        fcfs = [o.summary["by_class"]["short"]["ttft_s"] for o in outcomes[1:3]]
        ratios.append(
            (
                qps,
                min(f["p50"] for f in fcfs) / m["p50"],
                min(f["p99"] for f in fcfs) / m["p99"],
                long_done_by_last_arrival(medha),
                max(long_done_by_last_arrival(o) for o in outcomes[1:3]),
                medha.summary["by_class"]["long"]["count"],
            )
        )
    print("\n### Short-request TTFT, non-preemptive FCFS (better layout) / medha\n")
    print(
        "| QPS | p50 ratio | p99 ratio | long requests done by the last arrival "
        "(medha / best fcfs) | long requests in the run |"
    )
    print("|---|---|---|---|---|")
    for qps, p50, p99, lm, lf, total in ratios:
        print(f"| {qps} | {p50:.0f}x | {p99:.0f}x | {lm} / {lf} | {total} |")


def long_done_by_last_arrival(outcome) -> int:
    """Long requests finished while requests were still arriving: a run always drains, so
    this is where a policy that starves long requests would show."""
    reqs = outcome.result.requests
    horizon = max(r.arrival_s for r in reqs)
    return sum(
        1 for m, r in zip(outcome.rows, reqs) if m.request_class == "long" and r.finish_s <= horizon
    )


if __name__ == "__main__":
    main()
