"""PLA-Serve (prefill-length-aware serving) against a unified FCFS queue, simulated.

    python bench/sim_pla_serve.py [--scenarios colocated prefill] [--replicas 1 8]
                                  [--seconds 60] [--seed 0] [--ttft-floor-ms 250]

Llama-3-8B on H100s (TP1, roofline predictor), one replica and eight. A mixed multi-turn load:
sessions start as a Poisson process and send 4 turns on average, after exponential think times
(mean 4 s). A turn whose session prefix is cached prefills only the new user message
(log-normal, median 64 tokens, at most 255); one whose prefix was evicted (10% of turns)
prefills the whole conversation (a 1-3K-token context plus every earlier message and answer,
so above 1K). Answers are log-normal, median 160 tokens. Arrivals are generated for --seconds
and the sessions then run out.

Two scenarios. `colocated`: every replica prefills and decodes (medha's own batching: decodes
ride along in every iteration), at 30, 40 and 50 requests/s per replica. `prefill`: the
prefill instances of a prefill-decode disaggregated deployment, the paper's setting; a request
leaves at its first token (one output token; the KV transfer to a decode instance is not
modelled), at 40, 60 and 80 requests/s per replica.

Every run: adaptive chunking, 50 ms iteration budget (= the TPOT target), TTFT deadline
max(1.5 x isolated prefill time, 250 ms) (a chatbot TTFT SLO of 250 ms, as in DistServe; the
policies and the pla dispatcher see it; --ttft-floor-ms changes the floor). A request violates
its SLO when it misses its TTFT deadline or the TPOT target; misses of a stricter TTFT deadline
(the same rule with a 100 ms floor) are counted from the same runs. Short = below the boundary
L_m that the pla policy derives from the predictor. One replica: `--policy fcfs` against
`--policy pla`. Eight: fcfs behind round_robin and least_work, the pla policy behind
least_work (temporal disaggregation only) and behind the pla dispatcher (pools and the
instance-pressure controller).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections import Counter

from medha.core.config import SchedulerConfig
from medha.core.request import Request
from medha.perf import ParallelConfig
from medha.scheduler.policies.pla_policy import boundary_tokens
from medha.sim.metrics.summary import request_metrics
from medha.sim.simulator import ClusterConfig, Simulator

TURNS_MEAN, THINK_MEAN_S, MISS = 4.0, 4.0, 0.10
# (median, sigma, low, high) of log-normal token counts
MESSAGE, ANSWER, CONTEXT = (64, 0.8, 4, 255), (160, 0.7, 8, 1024), (1500, 0.35, 1024, 3072)
TPOT_S = 0.05
TTFT_FLOOR_S = 0.25
STRICT_FLOORS_MS = (100,)  # stricter TTFT deadline floors, counted after the runs
RATES = {"colocated": (30.0, 40.0, 50.0), "prefill": (40.0, 60.0, 80.0)}
CONFIGS = {
    1: [("fcfs", "fcfs", "round_robin"), ("pla", "pla", "round_robin")],
    8: [
        ("fcfs + round_robin", "fcfs", "round_robin"),
        ("fcfs + least_work", "fcfs", "least_work"),
        ("pla + least_work", "pla", "least_work"),
        ("pla + pla dispatcher", "pla", "pla"),
    ],
}


# ---- workload ---------------------------------------------------------------------------------
def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0, sigma)))))


def geometric(rng: random.Random, mean: float) -> int:
    """Failures before the first success, with the given mean."""
    return int(math.log(1 - rng.random()) / math.log(mean / (1 + mean)))


def sessions(rate: float, seconds: float, seed: int, prefill_only: bool = False) -> list[Request]:
    """Multi-turn conversations whose turns arrive at `rate` per second on average
    (`prefill_only`: each request ends at its first token, as on a prefill instance)."""
    rng = random.Random(seed)
    reqs, start = [], 0.0
    while True:
        start += rng.expovariate(rate / TURNS_MEAN)
        if start >= seconds:
            return reqs
        t, history = start, lognormal(rng, *CONTEXT)
        for _ in range(1 + geometric(rng, TURNS_MEAN - 1)):
            message, answer = lognormal(rng, *MESSAGE), lognormal(rng, *ANSWER)
            prompt = history + message if rng.random() < MISS else message
            reqs.append(Request(f"r{len(reqs)}", t, prompt, 1 if prefill_only else answer))
            history += message + answer
            t += rng.expovariate(1 / THINK_MEAN_S)


# ---- one run ----------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(
    policy: str,
    dispatcher: str,
    replicas: int,
    reqs: list[Request],
    ttft_floor_s: float = TTFT_FLOOR_S,
) -> dict:
    cluster = ClusterConfig(
        model="llama-3-8b", hardware="h100", replicas=replicas, dispatcher=dispatcher
    )
    config = SchedulerConfig(policy=policy, tpot_target_s=TPOT_S, min_ttft_deadline_s=ttft_floor_s)
    sim = Simulator(cluster, ParallelConfig(), config)
    result = sim.run(reqs)
    boundary = boundary_tokens(sim.predictor, config.pla.batching_gain, sim.max_model_len)
    rows = [request_metrics(r, boundary, TPOT_S) for r in reqs]
    # the same deadline rule with a lower floor: max(1.5 x isolated prefill time, floor)
    strict = {
        slo: sum(r.ttft_s > max(1.5 * r.total_work_s, slo / 1e3) for r in reqs) / len(reqs)
        for slo in STRICT_FLOORS_MS
    }
    return {
        "short": [m.ttft_s for m in rows if m.request_class == "short"],
        "long": [m.ttft_s for m in rows if m.request_class == "long"],
        "violations": sum(not m.slo_met for m in rows) / len(rows),
        "strict": strict,
        "boundary": boundary,
        "moves": len(getattr(result.dispatcher, "moves", ())),
        "awd": _awd(result.dispatcher.replicas),
    }


def _awd(replicas) -> Counter:
    """Short dispatches of the pla policy by depth and by reason, over every replica."""
    out: Counter = Counter()
    for replica in replicas:
        awd = getattr(replica.scheduler.policy, "awd", None)
        for d in awd.dispatches if awd else ():
            out["dispatches"] += 1
            out["prompts"] += d.depth
            out[d.reason] += 1  # depth, window or deadline
    return out


# ---- reporting --------------------------------------------------------------------------------
def table(results: dict) -> list[str]:
    floors = " | ".join(f"TTFT misses, {slo} ms floor" for slo in STRICT_FLOORS_MS)
    rows = [
        "| configuration | short TTFT mean | p50 | p90 | p99 | long TTFT p50 | p99 | "
        f"SLO violations | {floors} | pool moves |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(STRICT_FLOORS_MS) + "---|",
    ]
    for name, m in results.items():
        s, lg = m["short"], m["long"]
        strict = "".join(f"{100 * m['strict'][slo]:.2f}% | " for slo in STRICT_FLOORS_MS)
        rows.append(
            f"| {name} | {1e3 * statistics.mean(s):.1f} ms | {1e3 * pct(s, 0.5):.1f} ms | "
            f"{1e3 * pct(s, 0.9):.1f} ms | {1e3 * pct(s, 0.99):.1f} ms | "
            f"{1e3 * pct(lg, 0.5):.0f} ms | {1e3 * pct(lg, 0.99):.0f} ms | "
            f"{100 * m['violations']:.2f}% | {strict}{m['moves']} |"
        )
    return rows


def lower(base: float, ours: float) -> str:
    """'31% lower' / '12% higher' / 'none in either' / '0 -> 0.20%'."""
    if base == 0:
        return "none in either" if ours == 0 else f"0 -> {100 * ours:.2f}%"
    change = 1 - ours / base
    return f"{100 * abs(change):.0f}% {'lower' if change >= 0 else 'higher'}"


def fewer(base: dict, ours: dict) -> str:
    """SLO violations at medha's deadline, then at the stricter floors."""
    parts = [lower(base["violations"], ours["violations"])]
    parts += [
        f"{lower(base['strict'][slo], ours['strict'][slo])} ({slo} ms floor)"
        for slo in STRICT_FLOORS_MS
    ]
    return "; ".join(parts)


def summary(all_results: dict) -> list[str]:
    """Paper beside ours, one line per claim, scenario and rate."""
    rows = ["| claim | paper | scenario, rate per replica | ours |", "|---|---|---|---|"]
    for (scenario, replicas, rate), res in all_results.items():
        where = f"{scenario}, {rate:g}/s"
        if replicas == 1:
            b, o = res["fcfs"]["short"], res["pla"]["short"]
            rows.append(
                f"| short-prefill TTFT, one instance, vs a unified queue | over 30% lower | "
                f"{where} | mean {lower(statistics.mean(b), statistics.mean(o))}, p90 "
                f"{lower(pct(b, 0.9), pct(o, 0.9))}, p99 {lower(pct(b, 0.99), pct(o, 0.99))} |"
            )
            rows.append(
                f"| SLO violations, one instance | - | {where} | {fewer(res['fcfs'], res['pla'])} |"
            )
            continue
        ours = res["pla + pla dispatcher"]
        for base, claim in (
            ("fcfs + round_robin", "28% fewer (vs vanilla data parallel)"),
            ("fcfs + least_work", "12% fewer (vs a load-balancing router)"),
        ):
            rows.append(
                f"| SLO violations, {replicas} instances | {claim} | {where} | "
                f"{fewer(res[base], ours)} |"
            )
        b, o = res["fcfs + least_work"]["short"], ours["short"]
        rows.append(
            f"| short-prefill TTFT, {replicas} instances, vs fcfs + least_work | - | "
            f"{where} | mean {lower(statistics.mean(b), statistics.mean(o))}, p99 "
            f"{lower(pct(b, 0.99), pct(o, 0.99))} |"
        )
    return rows


def report(scenario: str, replicas: int, rate: float, results: dict, reqs: list[Request]) -> None:
    first = next(iter(results.values()))
    short = sum(r.prompt_len < first["boundary"] for r in reqs) / len(reqs)
    over_1k = sum(r.prompt_len > 1024 for r in reqs) / len(reqs)
    print(
        f"### {scenario}, {replicas} replica(s), {rate:g} req/s each: {len(reqs)} requests, "
        f"L_m = {first['boundary']} tokens, {100 * short:.0f}% short, "
        f"{100 * over_1k:.0f}% above 1K tokens\n"
    )
    print("\n".join(table(results)))
    for name, m in results.items():
        awd = m["awd"]
        if awd["dispatches"]:
            print(
                f"\n{name}: {awd['dispatches']} short dispatches (AWD), mean depth "
                f"{awd['prompts'] / awd['dispatches']:.2f}; released at depth D "
                f"{awd['depth']}, at the end of the window {awd['window']}, for a deadline "
                f"{awd['deadline']}"
            )
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenarios", nargs="+", default=list(RATES), choices=list(RATES))
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="requests per second per replica (default: per scenario)",
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="arrivals span this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ttft-floor-ms",
        type=float,
        default=1e3 * TTFT_FLOOR_S,
        help="smallest TTFT deadline, for every configuration (medha's default: 500)",
    )
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 8], choices=sorted(CONFIGS))
    args = ap.parse_args()
    t0 = time.perf_counter()
    all_results = {}
    for scenario in args.scenarios:
        for replicas in args.replicas:
            for rate in args.rates or RATES[scenario]:
                workload = (rate * replicas, args.seconds, args.seed, scenario == "prefill")
                # a fresh copy of the same request list for every run
                results = {
                    name: run(
                        policy, dispatcher, replicas, sessions(*workload), args.ttft_floor_ms / 1e3
                    )
                    for name, policy, dispatcher in CONFIGS[replicas]
                }
                all_results[scenario, replicas, rate] = results
                report(scenario, replicas, rate, results, sessions(*workload))
    print("### Paper beside ours\n")
    print("\n".join(summary(all_results)))
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
