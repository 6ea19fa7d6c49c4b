"""Simulator speed: the first 10,000 requests of splitwise_conv on one A100.

    python bench/sim/sim_speed.py [--num-requests 10000] [--repeats 3] [--predictor profiled]

Llama-3-8B, TP1, Sarathi-style static chunks of 512 tokens, at most 128 sequences per batch,
the trace's own arrival times; the fitted predictor on the bundled Vidur A100 profile.
Predictor set-up (fitting, prefill-time cache) is timed apart from the simulation.

With --vidur-python PATH (a Python with Vidur 0.0.26 installed, see bench/sim/vidur_anchor.py),
Vidur runs the same workload in the same invocation and the ratio is printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from medha.benchmark.harness import add_common_args
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.simulator import ClusterConfig, Simulator
from medha.sim.workload.generator import WorkloadConfig, build_requests


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap, num_requests=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--predictor", default="profiled")
    ap.add_argument(
        "--vidur-python",
        default=None,
        help="a Python with vidur==0.0.26, to run the anchor side by side",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    sim = Simulator(
        ClusterConfig(model="llama-3-8b", hardware="a100", predictor=args.predictor),
        ParallelConfig(tp=1),
        SchedulerConfig(chunking="static:512", max_num_seqs=128),
    )
    setup = time.perf_counter() - t0
    print(f"predictor and scheduler set-up: {setup:.2f} s (not counted below)")
    print(
        "| run | requests | iterations | simulated s | wall s | requests / wall s | "
        "simulated s / wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    rates = []
    for i in range(args.repeats):
        requests = build_requests(
            WorkloadConfig(trace="splitwise_conv", num_requests=args.num_requests),
            sim.max_model_len,
        )
        res = sim.run(requests)
        rates.append(len(requests) / res.wall_s)
        print(
            f"| medha {i + 1} | {len(requests)} | {len(res.log)} | {res.simulated_s:.0f} | "
            f"{res.wall_s:.2f} | {rates[-1]:.0f} | {res.simulated_s / res.wall_s:.0f} |"
        )
    if args.vidur_python:
        script = Path(__file__).with_name("vidur_anchor.py")
        out = subprocess.run(
            [args.vidur_python, str(script), "--num-requests", str(args.num_requests)],
            capture_output=True,
            text=True,
            check=True,
        )
        v = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| vidur 0.0.26 | {v['requests']} | {v['batches']} | {v['simulated_s']:.0f} | "
            f"{v['wall_s']:.2f} | {v['requests_per_wall_s']:.0f} | "
            f"{v['simulated_s'] / v['wall_s']:.0f} |"
        )
        print(
            f"\nmedha / vidur, requests per wall second: "
            f"{min(rates) / v['requests_per_wall_s']:.1f}x (medha's slowest run)"
        )


if __name__ == "__main__":
    main()
