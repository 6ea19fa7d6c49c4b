"""Convoy effect (the Medha paper's Figures 1, 9 and 10): Llama-3-8B on 16 A100s, ShareGPT with
5% long requests (Medha-SWE lengths), medha against the paper's baselines.

    python bench/paper/sim_convoy_effect.py [--qps 0.25 0.5 0.75] [--num-requests 500]
                                            [--long-fraction 0.05] [--predictor profiled] [--quick]

Systems, every one on the identical request list at each rate (CONFIGS below):
- medha: TP8 x SPP2, lars, adaptive chunking, multi-prefill (the paper's Medha);
- loongserve: 8 elastic TP2 instances, prefills spread over up to 4 (the paper's "TP-2, CP-4"),
  non-preemptive, FCFS; "+reserv", 2 of the 8 kept for short prompts (Figure 14); and
  "backfill", later requests may start on instances a waiting head leaves idle;
- medha-fcfs: the same mechanisms with FCFS order (the paper's "Medha-FCFS" of Figure 9b);
- sarathi static:512 / static:2048: FCFS with Sarathi's static chunks on TP8 x PP2 with
  microbatched pipelining (vLLM's chunked-prefill scheduler and pipeline, as the paper ran it:
  a request's next chunk waits for its previous one to leave the last stage);
- non-preemptive fcfs, 2 x TP8: whole prompts, FCFS, two TP8 replicas.
One-change runs, by --configs only: "loongserve, macro" and "loongserve +reserv, macro" start
prefills in macro iterations every 10 decode iterations, as LoongServe's released server does;
"medha, s / w(t)" orders by LARS's other formula (relative slack over the remaining work).
Prints one table per rate, then the convoy ratios (short-request TTFT of each baseline / medha's,
p50 and p99), and whether each run is below saturation: a baseline's short TTFT p50 over the last
third of the arrivals must stay within 2x (+1 s) of the first third's, else the ratio measures a
growing queue rather than the convoy. --long-fraction 0 is Figure 9a (short requests only), 0.01
the paper's 1%-long sensitivity. --window S measures as the paper did: requests arrive for S
seconds (the paper's 60-minute window: 3600) and only those finished by then count, so a run
beyond saturation reports the requests it served, not the queue it left.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from medha.benchmark.harness import add_common_args, percentile
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.config import LoongServeSettings
from medha.sim.runner import RunOutcome, RunSpec, compare_table, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

MODEL, HARDWARE = "llama-3-8b", "a100"


@dataclass(frozen=True)
class System:
    name: str
    policy: str = "lars"
    chunking: str = "adaptive"
    multi_prefill: bool = False
    tp: int = 8
    spp: int = 1
    replicas: int = 1
    system: str = "medha"
    reserved_short: int = 0  # loongserve: instances kept for short prompts (Figure 14)
    backfill: bool = False  # loongserve: later requests may pass a waiting head
    prefill_every: int = 0  # loongserve: macro iterations, as its released server runs
    ring: str = "striped"  # loongserve: contiguous, the plain ring of the paper's Fig. 5b
    pipeline: str = "stream"  # microbatch: vLLM's / Sarathi's pipeline parallelism
    lars_slack: str = SchedulerConfig().lars.slack
    lars_serve_early: bool = SchedulerConfig().lars.serve_early
    arrival_wait_s: float | None = None  # None: the default (docs/design.md)

    def spec(self, predictor: str) -> RunSpec:
        return RunSpec(
            name=self.name,
            cluster=ClusterConfig(
                model=MODEL,
                hardware=HARDWARE,
                predictor=predictor,
                replicas=self.replicas,
                system=self.system,
                loong=LoongServeSettings(
                    reserved_short=self.reserved_short,
                    backfill=self.backfill,
                    prefill_every=self.prefill_every,
                    ring=self.ring,
                ),
            ),
            parallel=ParallelConfig(tp=self.tp, spp=self.spp),
            scheduler=SchedulerConfig.from_flat(
                policy=self.policy,
                chunking=self.chunking,
                multi_prefill=self.multi_prefill,
                pipeline=self.pipeline,
                lars_slack=self.lars_slack,
                lars_serve_early=self.lars_serve_early,
                arrival_wait_s=self.arrival_wait_s,
            ),
        )


CONFIGS = [
    System("medha", "lars", "adaptive", multi_prefill=True, spp=2),
    # the paper's LoongServe: 8 elastic instances of TP2, a prefill over up to 4 of them
    # (medha/sim/baselines/loongserve.py), and its Figure 14 variant with 2 instances kept for
    # prompts under 8192 tokens
    System("loongserve", "fcfs", "none", tp=2, system="loongserve"),
    System("loongserve +reserv", "fcfs", "none", tp=2, system="loongserve", reserved_short=2),
    # the strict FCFS queue is our assumption: this run changes only it
    System("loongserve, backfill", "fcfs", "none", tp=2, system="loongserve", backfill=True),
    System("medha-fcfs", "fcfs", "adaptive", spp=2),
    System("sarathi static:512", "fcfs", "static:512", spp=2, pipeline="microbatch"),
    System("sarathi static:2048", "fcfs", "static:2048", spp=2, pipeline="microbatch"),
    # a whole prompt is one batch, which a pipeline cannot overlap with anything: two TP8
    # replicas are the fairer layout for a system without chunking
    System("non-preemptive fcfs, 2 x TP8", "fcfs", "none", replicas=2),
]
# one-change runs, by name only (--configs): each changes one assumption of a system above
ONE_CHANGE = [
    # a prefill starting whenever instances are free is ours: LoongServe's released server
    # starts them in macro iterations, every 10 decode iterations (its max_wait_tokens)
    System("loongserve, macro", "fcfs", "none", tp=2, system="loongserve", prefill_every=10),
    System(
        "loongserve +reserv, macro",
        "fcfs",
        "none",
        tp=2,
        system="loongserve",
        reserved_short=2,
        prefill_every=10,
    ),
    # LoongServe's ring priced as the plain contiguous ring, the one that reproduces the
    # paper's Fig. 5b (SPP 1.60x faster than CP; striped, CP is the faster)
    System(
        "loongserve, contiguous ring", "fcfs", "none", tp=2, system="loongserve", ring="contiguous"
    ),
    System(
        "loongserve +reserv, contiguous ring",
        "fcfs",
        "none",
        tp=2,
        system="loongserve",
        reserved_short=2,
        ring="contiguous",
    ),
    # medha with LARS's other formula, relative slack over the remaining work
    System(
        "medha, s / w(t)", "lars", "adaptive", multi_prefill=True, spp=2, lars_slack="remaining"
    ),
    # issue 35's rules, one at a time: LARS by its key alone (no serving early), and no step
    # longer than the budget (an arrival wait given under the budget resolves to the budget:
    # no step nobody waits on, overload's included, runs longer)
    System(
        "medha, key alone", "lars", "adaptive", multi_prefill=True, spp=2, lars_serve_early=False
    ),
    System(
        "medha, budget steps only",
        "lars",
        "adaptive",
        multi_prefill=True,
        spp=2,
        arrival_wait_s=0.01,
    ),
]
BY_NAME = {c.name: c for c in CONFIGS + ONE_CHANGE}


def add_configs_argument(ap: argparse.ArgumentParser, what: str) -> None:
    """--configs: systems by name (this bench's and bench/paper/sim_capacity.py's)."""
    ap.add_argument(
        "--configs",
        nargs="+",
        default=[c.name for c in CONFIGS],
        choices=list(BY_NAME),
        metavar="NAME",
        help=f"{what} (default: all but the one-change runs; those: "
        f"{', '.join(repr(c.name) for c in ONE_CHANGE)})",
    )


def workload(qps: float, n: int, seed: int, long_fraction: float = 0.05) -> WorkloadConfig:
    return WorkloadConfig(
        trace="sharegpt", qps=qps, num_requests=n, long_fraction=long_fraction, seed=seed
    )


def run_config(
    name: str, qps: float, n: int, seed: int, predictor: str, long_fraction: float = 0.05
) -> RunOutcome:
    return simulate(BY_NAME[name].spec(predictor), workload(qps, n, seed, long_fraction))


def stationary(outcome: RunOutcome) -> tuple[bool, str]:
    """Whether short requests' TTFT stays put over the run: p50 over the last third of the
    arrivals within 2x (+1 s) of the first third's. A saturated system's queue grows with the
    run, and so would any ratio taken against it."""
    shorts = sorted(
        (m.arrival_s, m.ttft_s) for m in outcome.rows if m.request_class == "short" and m.ttft_s
    )
    if len(shorts) < 6:
        return True, "-"
    third = len(shorts) // 3
    first = float(np.median([t for _, t in shorts[:third]]))
    last = float(np.median([t for _, t in shorts[-third:]]))
    ok = last <= 2 * first + 1.0
    return ok, f"{first:.3g} -> {last:.3g} s"


def windowed(outcome: RunOutcome, window_s: float) -> dict:
    """Short-request TTFT percentiles over the requests finished within `window_s` of the
    first arrival (the paper's profiling window: a request still running is not in its CDF),
    and how many of each class that leaves."""
    t0 = min(r.arrival_s for r in outcome.result.requests)
    done = [
        m
        for m, r in zip(outcome.rows, outcome.result.requests)
        if r.finish_s is not None and r.finish_s - t0 <= window_s
    ]
    shorts = [m.ttft_s for m in done if m.request_class == "short"]
    out = {"short_done": len(shorts), "long_done": len(done) - len(shorts)}
    if shorts:
        out["p50"], out["p99"] = (percentile(shorts, q) for q in (50, 99))
    return out


def long_done_by_last_arrival(outcome: RunOutcome) -> int:
    """Long requests finished while requests were still arriving: a run always drains, so
    this is where a policy that starves long requests would show."""
    reqs = outcome.result.requests
    horizon = max(r.arrival_s for r in reqs)
    return sum(
        1 for m, r in zip(outcome.rows, reqs) if m.request_class == "long" and r.finish_s <= horizon
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, nargs="+", default=[0.125, 0.25, 0.5, 0.75])
    add_common_args(ap, seed=0, num_requests=500)
    ap.add_argument("--long-fraction", type=float, default=0.05)
    ap.add_argument(
        "--predictor",
        default="profiled",
        help="profiled (default: the bundled A100 Llama-3-8B profile; attention on the roofline) "
        "or roofline",
    )
    add_configs_argument(ap, "systems to run, the first the reference of the ratios")
    ap.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds of arrivals, counting only requests finished within them (the paper's "
        "60-minute profiling window: 3600); replaces --num-requests with qps x window",
    )
    ap.add_argument("--quick", action="store_true", help="one rate, 60 requests (CI)")
    args = ap.parse_args()
    if args.quick:
        args.qps, args.num_requests = [0.25], 60
    ratios, windows = [], []
    for qps in args.qps:
        n = round(qps * args.window) if args.window else args.num_requests
        outcomes = [
            run_config(name, qps, n, args.seed, args.predictor, args.long_fraction)
            for name in args.configs
        ]
        if args.window:
            windows += [(qps, o.spec.name, windowed(o, args.window)) for o in outcomes]
        print(
            f"\n### {qps} QPS ({n} requests, {args.long_fraction:.0%} long, "
            f"seed {args.seed}, predictor {args.predictor})\n"
        )
        print(compare_table(outcomes)[0])
        medha = outcomes[0].summary["by_class"]["short"]["ttft_s"]
        for o in outcomes[1:]:
            s = o.summary["by_class"]["short"]["ttft_s"]
            ok, why = stationary(o)
            ratios.append(
                (
                    qps,
                    o.spec.name,
                    s["p50"] / medha["p50"],
                    s["p99"] / medha["p99"],
                    ok,
                    why,
                    long_done_by_last_arrival(o),
                    long_done_by_last_arrival(outcomes[0]),
                    o.summary["by_class"].get("long", {}).get("count", 0),
                )
            )
    print(f"\n### Short-request TTFT, baseline / {args.configs[0]}\n")
    print(
        "| QPS | baseline | p50 ratio | p99 ratio | below saturation | baseline short TTFT p50, "
        "first -> last third | long done by the last arrival (baseline / medha) | long in run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for qps, name, p50, p99, ok, why, lb, lm, total in ratios:
        print(
            f"| {qps} | {name} | {p50:.1f}x | {p99:.1f}x | {'yes' if ok else 'no'} | {why} "
            f"| {lb} / {lm} | {total} |"
        )
    if windows:
        print(f"\n### Within the {args.window:.0f} s window: requests finished by its end only\n")
        print(
            "| QPS | run | short TTFT p50 | short TTFT p99 | shorts done | longs done "
            "| p50 / medha's | p99 / medha's |"
        )
        print("|---|---|---|---|---|---|---|---|")
        base = {q: w for q, name, w in windows if name == args.configs[0]}
        for qps, name, w in windows:
            b = base[qps]
            r50 = f"{w['p50'] / b['p50']:.1f}x" if "p50" in w and "p50" in b else "-"
            r99 = f"{w['p99'] / b['p99']:.1f}x" if "p99" in w and "p99" in b else "-"
            p50 = f"{w['p50']:.3g} s" if "p50" in w else "-"
            p99 = f"{w['p99']:.3g} s" if "p99" in w else "-"
            print(
                f"| {qps} | {name} | {p50} | {p99} | {w['short_done']} | {w['long_done']} "
                f"| {r50} | {r99} |"
            )


if __name__ == "__main__":
    main()
