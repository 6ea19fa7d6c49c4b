"""Scheduling policies (Medha Fig. 13): fcfs, edf, lars and lars + multi-prefill.

    python bench/paper/sim_policies.py [--qps 0.25 1.75] [--num-requests 500] [--lars-slack both]

Llama-3-8B on 16 A100s (TP8 x SPP2), ShareGPT + 5% long requests, adaptive chunking for all;
multi-prefill only in the lars + multi-prefill rows, as in the paper. The lars rows run once per
relative-slack formula of --lars-slack (remaining: s / w(t), medha's; total: s / w_total, the
paper's; both: a row for each).
"""

from __future__ import annotations

import argparse

from medha.benchmark.harness import add_common_args
from medha.core.config import LARS_SLACK_MODES
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.runner import RunSpec, compare_table, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

# the bundled A100 profile covers Llama-3-8B: the fitted predictor (--predictor)
PREDICTOR = "profiled"


def configs(formulas: list[str]) -> list[tuple[str, dict]]:
    """(row name, scheduler settings) of every row."""
    default = SchedulerConfig().lars.slack
    rows = [("fcfs", dict(policy="fcfs", multi_prefill=False))]
    rows.append(("edf", dict(policy="edf", multi_prefill=False)))
    for multi in (False, True):
        for per in formulas:
            name = "lars + multi-prefill" if multi else "lars"
            if len(formulas) > 1 or per != default:
                name += f" ({per})"
            rows.append((name, dict(policy="lars", multi_prefill=multi, lars_slack=per)))
    return rows


def by_class_table(outcomes) -> str:
    """SLO attainment (TTFT deadline and TPOT target) overall and per class."""
    md = [
        "| run | SLO attainment | shorts | longs | TTFT met | TPOT met |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        s = o.summary
        md.append(
            f"| {o.spec.name} | {s['slo_attainment']:.1%} | "
            f"{s['by_class']['short']['slo_attainment']:.1%} | "
            f"{s['by_class']['long']['slo_attainment']:.1%} | "
            f"{s['ttft_attainment']:.1%} | {s['tpot_attainment']:.1%} |"
        )
    return "\n".join(md)


def main() -> None:
    global PREDICTOR
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, nargs="+", default=[0.25, 1.75])
    add_common_args(ap, seed=0, num_requests=500)
    ap.add_argument(
        "--predictor",
        default=PREDICTOR,
        help="profiled (default: the bundled A100 Llama-3-8B profile, attention on the "
        "roofline) or roofline",
    )
    ap.add_argument(
        "--lars-slack",
        choices=[*LARS_SLACK_MODES, "both"],
        default="both",
        help="the lars rows' relative-slack formula (both: a row for each)",
    )
    args = ap.parse_args()
    PREDICTOR = args.predictor
    formulas = list(LARS_SLACK_MODES) if args.lars_slack == "both" else [args.lars_slack]
    rows = configs(formulas)
    for qps in args.qps:
        work = WorkloadConfig(
            trace="sharegpt",
            qps=qps,
            num_requests=args.num_requests,
            long_fraction=0.05,
            seed=args.seed,
        )
        outcomes = {
            name: simulate(
                RunSpec(
                    name=name,
                    cluster=ClusterConfig(hardware="a100", predictor=PREDICTOR),
                    parallel=ParallelConfig(tp=8, spp=2),
                    scheduler=SchedulerConfig.from_flat(**settings),
                ),
                work,
            )
            for name, settings in rows
        }
        print(
            f"\n### {qps} QPS ({args.num_requests} requests, seed {args.seed}, "
            f"predictor {PREDICTOR})\n"
        )
        print(compare_table(list(outcomes.values()))[0])
        print()
        print(by_class_table(list(outcomes.values())))
        print()
        names = list(outcomes)
        lars_rows = [n for n in names if n.startswith("lars") and "multi" not in n]
        for base_name, multi_name in zip(lars_rows, [n for n in names if "multi" in n]):
            base = outcomes[base_name].summary["by_class"]["short"]["ttft_s"]["p50"]
            multi = outcomes[multi_name].summary["by_class"]["short"]["ttft_s"]["p50"]
            print(
                f"multi-prefill, {base_name}: short TTFT p50 {base:.3f} s -> {multi:.3f} s "
                f"({base / multi:.2f}x)  "
            )


if __name__ == "__main__":
    main()
