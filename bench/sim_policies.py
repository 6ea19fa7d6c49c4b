"""Scheduling policies (Medha Fig. 13): fcfs, edf, lars and lars + multi-prefill.

    python bench/sim_policies.py [--qps 0.25 1.75] [--num-requests 500]

Llama-3-8B on 16 A100s (TP8 x SPP2), ShareGPT + 5% long requests, adaptive chunking for all;
multi-prefill only in the last configuration, as in the paper.
"""

from __future__ import annotations

import argparse

from medha.core.config import SchedulerConfig
from medha.perf import ParallelConfig
from medha.sim.runner import RunSpec, compare_table, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

CONFIGS = [
    ("fcfs", "fcfs", False),
    ("edf", "edf", False),
    ("lars", "lars", False),
    ("lars + multi-prefill", "lars", True),
]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, nargs="+", default=[0.25, 1.75])
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for qps in args.qps:
        work = WorkloadConfig(
            trace="sharegpt",
            qps=qps,
            num_requests=args.num_requests,
            long_fraction=0.05,
            seed=args.seed,
        )
        outcomes = [
            simulate(
                RunSpec(
                    name=name,
                    cluster=ClusterConfig(hardware="a100"),
                    parallel=ParallelConfig(tp=8, spp=2),
                    scheduler=SchedulerConfig(policy=policy, multi_prefill=multi),
                ),
                work,
            )
            for name, policy, multi in CONFIGS
        ]
        print(f"\n### {qps} QPS ({args.num_requests} requests, seed {args.seed})\n")
        print(compare_table(outcomes)[0])
        base = outcomes[2].summary["by_class"]["short"]["ttft_s"]["p50"]
        multi = outcomes[3].summary["by_class"]["short"]["ttft_s"]["p50"]
        print(
            f"\nmulti-prefill: short TTFT p50 {base:.3f} s -> {multi:.3f} s ({base / multi:.2f}x)"
        )


if __name__ == "__main__":
    main()
