"""Adaptive vs static chunking (Medha Fig. 4, 10): the TTFT / TPOT trade-off.

    python bench/paper/sim_chunking.py [--qps 0.5] [--num-requests 400] \
        [--plot docs/img/chunking_tradeoff.png]

Llama-3-8B on 16 A100s (TP8 x SPP2), ShareGPT + 5% long requests, lars for every run so that
only the chunking differs: static chunks of 256 to 4096 tokens against adaptive chunking with
TPOT targets of 25 to 200 ms. Static chunks cost ever more per iteration as a long
request's KV grows; a time budget does not. One more run changes one thing: the 25 ms target
without the overload steps (`--no-overload-steps`: a request past its TTFT deadline still
waits on every step; docs/design.md, "The iteration budget").
"""

from __future__ import annotations

import argparse

from medha.benchmark.harness import add_common_args
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.runner import RunSpec, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

STATIC = [256, 512, 1024, 2048, 4096]
BUDGETS_MS = [25, 50, 100, 200]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, default=0.5)
    add_common_args(ap, seed=0, num_requests=400)
    ap.add_argument("--plot", default=None, help="write the trade-off plot here")
    ap.add_argument(
        "--predictor",
        default="profiled",
        help="profiled (default: the bundled A100 Llama-3-8B profile; attention on the roofline) "
        "or roofline",
    )
    ap.add_argument("--quick", action="store_true", help="100 requests (CI)")
    args = ap.parse_args()
    if args.quick:
        args.num_requests = 100
    work = WorkloadConfig(
        trace="sharegpt",
        qps=args.qps,
        num_requests=args.num_requests,
        long_fraction=0.05,
        seed=args.seed,
    )
    runs = [(f"static:{n}", SchedulerConfig(policy="lars", chunking=f"static:{n}")) for n in STATIC]
    # the adaptive packer derives its iteration budget from the TPOT target (with SPP2, 2/3
    # of it, leaving room for a decode to wait one stage for its next slot)
    runs += [
        (f"adaptive {b} ms", SchedulerConfig(policy="lars", tpot_target_s=b / 1e3))
        for b in BUDGETS_MS
    ]
    runs.append(
        (
            f"adaptive {BUDGETS_MS[0]} ms, no overload steps",
            SchedulerConfig(policy="lars", tpot_target_s=BUDGETS_MS[0] / 1e3, overload_steps=False),
        )
    )
    rows = []
    for name, sched in runs:
        s = simulate(
            RunSpec(
                name=name,
                cluster=ClusterConfig(hardware="a100", predictor=args.predictor),
                parallel=ParallelConfig(tp=8, spp=2),
                scheduler=sched,
            ),
            work,
        ).summary
        rows.append(
            (
                name,
                s["tpot_s"]["p50"],
                s["tpot_s"]["p99"],
                s["tbt_s"]["p99"],
                s["by_class"]["long"]["ttft_s"]["p50"],
                s["by_class"]["short"]["ttft_s"]["p99"],
                s["throughput"]["output_tokens_per_s"],
                s["by_class"]["long"]["ttft_s"]["p99"],
                s["by_class"]["long"]["tpot_s"]["p99"],
            )
        )
    print(
        f"{args.qps} QPS, {args.num_requests} requests, predictor {args.predictor}; static runs "
        "keep the default 50 ms TPOT target, adaptive runs name theirs\n"
    )
    print(
        "| chunking | TPOT p50 | TPOT p99 | TBT p99 | long TTFT p50 | short TTFT p99 "
        "| output tok/s | long TTFT p99 | long TPOT p99 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, t50, t99, b99, lt, st, tok_s, lt99, ltpot in rows:
        print(
            f"| {name} | {t50 * 1e3:.0f} ms | {t99 * 1e3:.0f} ms | {b99 * 1e3:.0f} ms | "
            f"{lt:.1f} s | {st:.2f} s | {tok_s:.0f} | {lt99:.0f} s | {ltpot * 1e3:.0f} ms |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        series = (  # (label, marker, the rows it draws)
            ("static", "s", lambda n: n.startswith("static")),
            ("adaptive", "o", lambda n: n.startswith("adaptive") and "overload" not in n),
            ("adaptive, no overload steps", "x", lambda n: "overload" in n),
        )
        for kind, marker, drawn in series:
            pts = [(r[2] * 1e3, r[4], r[0]) for r in rows if drawn(r[0])]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=kind)
            for x, y, label in pts:
                ax.annotate(
                    label.split(":")[-1].replace("adaptive ", "").split(",")[0],
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                )
        ax.set_xlabel("TPOT p99 (ms)")
        ax.set_ylabel("long-request TTFT p50 (s)")
        ax.set_xscale("log")
        ax.set_title("Chunking: prefill latency vs decode latency")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
