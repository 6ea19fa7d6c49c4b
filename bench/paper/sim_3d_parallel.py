"""Medha 2D against Medha 3D (the Medha paper's Figures 11 and 12): Llama-3-70B on 64 H100s.

    python bench/paper/sim_3d_parallel.py [--qps 0.25 0.75 1.25 1.75] [--num-requests 300] [--quick]

Two layouts with the same 64 devices, both TP8: SPP8 (2D) and SPP4 x KVP2 (3D). ShareGPT with
5% long requests whose prompts are Medha-SWE's scaled to 2M tokens (the paper's "5% long-context
(2M token) requests, scaled from the Medha-SWE trace"), lars with adaptive chunking and
multi-prefill. Prints per rate the TTFT (Figure 11) and TPOT (Figure 12) percentiles of both
layouts and the 3D / 2D ratios; the paper reports similar TTFT, somewhat lower peak throughput
for 3D at 1.25-1.75 QPS, and TPOT over 2x lower with 3D at 1.75 QPS (P50 and P90).
"""

from __future__ import annotations

import argparse

from medha.benchmark.harness import add_common_args
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.runner import RunSpec, compare_table, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import LONG_PREFILL, WorkloadConfig

LAYOUTS = [
    ("Medha-2D (TP8 x SPP8)", ParallelConfig(tp=8, spp=8)),
    ("Medha-3D (TP8 x SPP4 x KVP2)", ParallelConfig(tp=8, spp=4, kvp=2)),
]
# Medha-SWE's prompts (128K-1M) times two: up to 2M tokens, and the context to hold them
LONG_SCALE = 2.0
MAX_MODEL_LEN = 1 << 21


def run(
    qps: float,
    n: int,
    seed: int,
    predictor: str,
    long_scale: float = LONG_SCALE,
    overload_steps: bool = True,
):
    work = WorkloadConfig(
        trace="sharegpt",
        qps=qps,
        num_requests=n,
        long_fraction=0.05,
        long_scale=long_scale,
        seed=seed,
    )
    return [
        simulate(
            RunSpec(
                name=name,
                cluster=ClusterConfig(model="llama-3-70b", hardware="h100", predictor=predictor),
                parallel=parallel,
                scheduler=SchedulerConfig(
                    multi_prefill=True,
                    overload_steps=overload_steps,
                    max_model_len=max(MAX_MODEL_LEN, int(LONG_PREFILL["high"] * long_scale)),
                ),
            ),
            work,
        )
        for name, parallel in LAYOUTS
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, nargs="+", default=[0.25, 0.75, 1.25, 1.75])
    add_common_args(ap, seed=0, num_requests=300)
    ap.add_argument(
        "--predictor",
        default="roofline",
        help="no H100 compute profile is bundled: roofline (default)",
    )
    ap.add_argument(
        "--long-scale",
        type=float,
        default=LONG_SCALE,
        help="long prompts as Medha-SWE's times this (default 2: up to 2M tokens; 4 puts the "
        "longest decodes past SPP8's iteration budget, where KVP has something to gain)",
    )
    ap.add_argument(
        "--no-overload-steps",
        dest="overload_steps",
        action="store_false",
        help="the one-change run: a request past its TTFT deadline waits on every step like any "
        "other (SchedulerConfig.overload_steps off; by default a step runs to the arrival wait "
        "once every decode and short prefill is late)",
    )
    ap.add_argument("--quick", action="store_true", help="one rate, 60 requests (CI)")
    args = ap.parse_args()
    if args.quick:
        args.qps, args.num_requests = [0.25], 60
    rows = []
    for qps in args.qps:
        two, three = run(
            qps, args.num_requests, args.seed, args.predictor, args.long_scale, args.overload_steps
        )
        print(
            f"\n### {qps} QPS ({args.num_requests} requests, seed {args.seed}, long prompts "
            f"x{args.long_scale:g}{'' if args.overload_steps else ', no overload steps'})\n"
        )
        print(compare_table([two, three])[0])
        rows.append((qps, two.summary, three.summary))
    print("\n### 3D / 2D\n")
    print(
        "| QPS | TTFT p50 2D / 3D | TTFT p90 2D / 3D | TPOT p50 2D / 3D | TPOT p90 2D / 3D "
        "| long TPOT p50 2D / 3D | long TPOT p90 2D / 3D | TPOT p90 2D / 3D ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def pair(a: dict, b: dict, path: tuple, scale: float = 1.0, unit: str = "s") -> str:
        x, y = a, b
        for k in path:
            x, y = (x or {}).get(k), (y or {}).get(k)
        if x is None or y is None:
            return "-"
        return f"{x * scale:.3g} / {y * scale:.3g} {unit}"

    for q, a, b in rows:
        print(
            f"| {q} | {pair(a, b, ('ttft_s', 'p50'))} | {pair(a, b, ('ttft_s', 'p90'))} "
            f"| {pair(a, b, ('tpot_s', 'p50'), 1e3, 'ms')} "
            f"| {pair(a, b, ('tpot_s', 'p90'), 1e3, 'ms')} "
            f"| {pair(a, b, ('by_class', 'long', 'tpot_s', 'p50'), 1e3, 'ms')} "
            f"| {pair(a, b, ('by_class', 'long', 'tpot_s', 'p90'), 1e3, 'ms')} "
            f"| {a['tpot_s']['p90'] / b['tpot_s']['p90']:.2f}x |"
        )


if __name__ == "__main__":
    main()
