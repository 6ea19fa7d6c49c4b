"""LARS's two relative-slack formulas, what holds LARS without multi-prefill back, and what
multi-prefill adds to capacity (issue 32).

    python bench/sim/sim_lars.py starvation
    python bench/sim/sim_lars.py causes [--qps 0.25 1.75] [--num-requests 500]
    python bench/sim/sim_lars.py capacity [--num-requests 500] [--target 0.9]

starvation: the starvation stream of medha/benchmark/scenarios.py (a 500K-token prompt, then a
1500-token request every 32 ms) under edf, fcfs and lars with either formula (--lars-slack
remaining: s / w(t); total: s / w_total, the paper's), multi-prefill on and off; lars in each
of the orderings of `causes` below.

causes: Fig. 13's setting (Llama-3-8B, 16 A100s as TP8 x SPP2, ShareGPT + 5% long requests),
lars with each formula, multi-prefill off and on, each as configured (serving a short prefill
early where no one misses for it, issue 35), by LARS's key alone (--no-lars-serve-early, the
paper's LARS), and by its key alone with no floor under the deadlines the scheduler orders by
(--min-ttft-deadline-s 0.001, so that a request's deadline is 1.5x its predicted prefill time,
as for every long request already).
Every row is scored against the default deadlines, max(1.5 x w, 0.5 s), whatever the scheduler
ordered by, so that the runs differ in the schedule only.

capacity: the same setting; the highest rate at which --target of the requests meet their
TTFT deadline (the default one) and the TPOT target, multi-prefill on against off: the rate is
halved from 0.25 QPS until the target holds, then doubled until it breaks and bisected in log
space (medha plan's capacity_chain).
"""

from __future__ import annotations

import argparse

import numpy as np

from medha.benchmark.harness import add_common_args, percentile
from medha.benchmark.scenarios import steady_stream
from medha.core.config import LARS_SLACK_MODES, MIN_TTFT_DEADLINE_S
from medha.perf import ParallelConfig
from medha.plan.search import capacity_search
from medha.scheduler.config import SchedulerConfig
from medha.sim.runner import RunSpec, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

NO_FLOOR = dict(min_ttft_deadline_s=1e-3)
# how lars orders: as configured (serving short prefills early where no one misses for them,
# issue 35), by its key alone (the paper's LARS), and by its key alone without the floor
ORDERINGS = {
    "serve early": {},
    "key alone": dict(lars_serve_early=False),
    "key alone, ordered by 1.5 w (no floor)": dict(NO_FLOOR, lars_serve_early=False),
}
FLOOR_S = MIN_TTFT_DEADLINE_S  # what every row is scored against (the default on GPUs)


# the bundled A100 profile covers Llama-3-8B: the fitted predictor (--predictor)
PREDICTOR = "profiled"


def starvation() -> None:
    print("Starvation stream: a 500K-token prompt at t=0, then a 1500-token request (100")
    print("output tokens) every 32 ms for 50 s; Llama-3-8B, 8xH100 TP8, 50 ms budget.\n")
    print(
        "| policy | lars slack | multi-prefill | long TTFT / deadline | shorts meeting TTFT | "
        "short TTFT p50 | p99 | max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cases = [(p, "-", m, None) for p in ("fcfs", "edf") for m in (True, False)]
    cases += [
        ("lars", per, m, variant)
        for variant in ORDERINGS
        for m in (True, False)
        for per in LARS_SLACK_MODES
    ]
    for policy, per, multi, variant in cases:
        extra = {} if per == "-" else {"lars_slack": per}
        if variant is not None:
            extra.update(ORDERINGS[variant])
        long_, shorts = steady_stream(policy, multi_prefill=multi, **extra)
        ttft = np.array([r.ttft_s for r in shorts])
        # scored against the default deadline (0.5 s, the floor) however it was ordered
        met = np.mean([r.ttft_s <= max(r.deadline_s - r.arrival_s, FLOOR_S) for r in shorts])
        name = f"{policy}, {variant}" if variant else policy
        print(
            f"| {name} | {per} | {'on' if multi else 'off'} | {long_.ttft_s:.2f} / "
            f"{long_.deadline_s - long_.arrival_s:.2f} s | {met:.1%} | "
            f"{percentile(ttft, 50):.3f} s | {percentile(ttft, 99):.3f} s | "
            f"{ttft.max():.3f} s |"
        )


def run(qps: float, num_requests: int, seed: int, **settings) -> dict:
    """One Fig. 13 run, scored against the default deadlines."""
    work = WorkloadConfig(
        trace="sharegpt", qps=qps, num_requests=num_requests, long_fraction=0.05, seed=seed
    )
    spec = RunSpec(
        cluster=ClusterConfig(hardware="a100", predictor=PREDICTOR),
        parallel=ParallelConfig(tp=8, spp=2),
        scheduler=SchedulerConfig.from_flat(**settings),
    )
    rows = simulate(spec, work).rows
    # the default deadline is max(1.5 w, floor); a run without the floor ordered by 1.5 w
    met = {
        m.request_id: m.ttft_s is not None
        and m.ttft_s <= max(m.ttft_deadline_s, FLOOR_S)
        and m.tpot_met
        for m in rows
    }

    def share(cls):
        sel = [met[m.request_id] for m in rows if cls in (None, m.request_class)]
        return float(np.mean(sel))

    def ttft(cls, q):
        return percentile([m.ttft_s for m in rows if m.request_class == cls], q)

    return {
        "slo": share(None),
        "short": share("short"),
        "long": share("long"),
        "short_p50": ttft("short", 50),
        "short_p99": ttft("short", 99),
        "long_p50": ttft("long", 50),
        "long_p99": ttft("long", 99),
    }


def causes(qps_list: list[float], num_requests: int, seed: int) -> None:
    for qps in qps_list:
        print(f"\n### {qps} QPS ({num_requests} requests, seed {seed})\n")
        print(
            "| lars slack | ordered by | multi-prefill | SLO attainment | shorts | "
            "longs | short TTFT p50 | p99 | long TTFT p50 | p99 |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        gains = []
        for per in LARS_SLACK_MODES:
            for floor, extra in ORDERINGS.items():
                p50 = {}
                for multi in (False, True):
                    r = run(
                        qps,
                        num_requests,
                        seed,
                        policy="lars",
                        lars_slack=per,
                        multi_prefill=multi,
                        **extra,
                    )
                    p50[multi] = r["short_p50"]
                    print(
                        f"| {per} | {floor} | {'on' if multi else 'off'} | {r['slo']:.1%} | "
                        f"{r['short']:.1%} | {r['long']:.1%} | {r['short_p50']:.3f} s | "
                        f"{r['short_p99']:.3f} s | {r['long_p50']:.1f} s | {r['long_p99']:.1f} s |",
                        flush=True,
                    )
                gains.append((per, floor, p50[False], p50[True]))
        print()
        for per, floor, off, on in gains:
            print(
                f"multi-prefill, {per}, {floor}: short TTFT p50 {off:.3f} s -> "
                f"{on:.3f} s ({off / on:.2f}x)  "
            )


def capacity(
    settings: dict, num_requests: int, seed: int, target: float, steps: int, max_qps: float
) -> tuple[float, bool]:
    """The highest rate at which `target` of the requests meet their SLOs, and whether it
    still met them at --max-qps (the capacity is then at least that)."""
    seen: list[tuple[float, float]] = []

    def attained(qps: float) -> float:
        a = run(qps, num_requests, seed, **settings)["slo"]
        seen.append((qps, a))
        print(f"  {settings} at {qps:.4g} QPS: {a:.1%}", flush=True)
        return a

    return capacity_search(attained, lambda a: a >= target, 0.25, max_qps, steps)


def main() -> None:
    global PREDICTOR
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["starvation", "causes", "capacity"])
    ap.add_argument("--qps", type=float, nargs="+", default=[0.25, 1.75])
    add_common_args(ap, seed=0, num_requests=500)
    ap.add_argument(
        "--predictor",
        default=PREDICTOR,
        help="profiled (default: the bundled A100 Llama-3-8B profile, attention on the "
        "roofline) or roofline",
    )
    ap.add_argument("--target", type=float, default=0.9, help="capacity: SLO attainment kept")
    ap.add_argument("--steps", type=int, default=3, help="capacity: bisection steps")
    ap.add_argument("--max-qps", type=float, default=8.0, help="capacity: highest rate tried")
    ap.add_argument(
        "--lars-slack",
        choices=LARS_SLACK_MODES,
        default=SchedulerConfig().lars.slack,
        help="capacity: the lars formula",
    )
    args = ap.parse_args()
    PREDICTOR = args.predictor
    if args.what == "starvation":
        starvation()
    elif args.what == "causes":
        causes(args.qps, args.num_requests, args.seed)
    else:
        rows = []
        for floor, extra in (("max(1.5 w, 0.5 s)", {}), ("1.5 w (no floor)", NO_FLOOR)):
            cap = {}
            for multi in (False, True):
                settings = dict(
                    policy="lars", lars_slack=args.lars_slack, multi_prefill=multi, **extra
                )
                cap[multi] = capacity(
                    settings, args.num_requests, args.seed, args.target, args.steps, args.max_qps
                )
            rows.append((floor, cap[False], cap[True]))
        print(
            f"\nCapacity: highest QPS with {args.target:.0%} of {args.num_requests} requests "
            f"meeting TTFT (default deadlines) and TPOT; lars ({args.lars_slack}); "
            f"{args.steps} bisection steps\n"
        )
        print("| deadlines ordered by | multi-prefill off | on | gain |")
        print("|---|---|---|---|")
        for floor, (off, off_capped), (on, on_capped) in rows:
            at_least = ">= " if on_capped and not off_capped else ""
            gain = f"{at_least}{on / off:.2f}x" if off > 0 else "-"
            print(
                f"| {floor} | {'>= ' * off_capped}{off:.3g} QPS | {'>= ' * on_capped}{on:.3g} "
                f"QPS | {gain} |"
            )


if __name__ == "__main__":
    main()
