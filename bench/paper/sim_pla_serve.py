"""PLA-Serve (She et al.) in the simulator: Figures 5, 6, 7 and Table 2 of the paper.

    python bench/paper/sim_pla_serve.py [--only fig5 fig6 fig7 table2] [--models qwen2.5-7b ...]
                                  [--quick]

Every run is a prefill instance of a prefill-decode disaggregated deployment (the paper's
setting): a request leaves at its first token. Qwen2.5-7B/14B/32B on H200s (the paper's; the
specs from the checkpoints' config.json), chunked prefill of 8,192 tokens (SGLang's default
chunk), a 0.4 s TTFT SLO on every request. The four configurations of Figure 6:

- vanilla: fcfs, one queue, prefills launched eagerly (`--predictor roofline-eager`);
- graph only: fcfs, CUDA graphs for short batches that fit a captured shape (`roofline-graph`);
- disaggregation only: `--policy pla` (and `--dispatcher pla` on 8 instances), eager;
- full PLA: `--policy pla` (+ `--dispatcher pla`) with graphs.

The workloads are synthetic multi-turn conversations (LMsys-Chat-1M and ShareGPT are not
bundled): a session's first prompt and each later user message are log-normal, shaped to the
paper's Figure 2 (LMsys: 63% of first prompts and 81% of later messages under 256 tokens), and
each turn's prompt is the session's context so far plus the new message (answers are not fed
back: on a prefill instance the decode's tokens are not in its cache). On one instance the
prefix cache holds the history, so a turn prefills only its message over H cached tokens (the
pla policy classes it by L_m(H)); on eight instances no dispatcher keeps a session on one
instance, so there a turn is its new message alone (no history).
"""

from __future__ import annotations

import argparse
import time

from medha.benchmark.pla_runs import CHUNK, metrics, simulate
from medha.benchmark.pla_workload import (
    LMSYS,
    SHAREGPT,
    SLO_S,
    ClosedLoop,
    Sessions,
    Shape,
    lognormal_for,
    poisson,
)
from medha.core.request import Request
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.simulator import ClusterConfig, Simulator

CONFIGS = {
    # name: (policy, predictor, dispatcher on 8 instances, scheduler settings)
    "vanilla": ("fcfs", "roofline-eager", "round_robin", {}),
    # the same routed by least work: PLA's dispatcher differs from vanilla in one thing only
    # against this one (its pools), not in its routing too
    "vanilla, least work": ("fcfs", "roofline-eager", "least_work", {}),
    "graph only": ("fcfs", "roofline-graph", "round_robin", {}),
    "disaggregation only": ("pla", "roofline-eager", "pla", {}),
    "full PLA": ("pla", "roofline-graph", "pla", {}),
}
# --trace: the same run with one assumption changed each (docs/reproductions.md)
TRACES = {
    "pla policy behind least work": ("pla", "roofline-graph", "least_work", {}),
    "full PLA, graph where faster": ("pla", "roofline-graph-min", "pla", {}),
    "full PLA, longs batched": ("pla", "roofline-graph", "pla", {"pla_long_batch": "all"}),
    "full PLA, both": ("pla", "roofline-graph-min", "pla", {"pla_long_batch": "all"}),
}


def pct(a: float, b: float) -> str:
    return f"{100 * (b / a - 1):+.0f}%"


# ---- Figure 5: latency and throughput against the waiting window ---------------------------
def fig5(args) -> None:
    print("### Figure 5: a fixed waiting window W, 64 closed-loop clients of short prefills")
    print("(Qwen2.5-14B, one H200, full PLA with W fixed and D = 64; prompts under 256 tokens;")
    print(f"think time exponential, mean {args.think_ms:g} ms)\n")
    print("| W (ms) | throughput (req/s) | mean latency (ms) | P90 (ms) | mean batch depth |")
    print("|---|---|---|---|---|")
    short = Shape(lognormal_for(60, 0.97), lognormal_for(60, 0.97), 1.0)
    for w in (0, 2, 5, 10, 20, 40):
        loop = ClosedLoop(Sessions(short, 5, False), 64, args.requests, args.think_ms / 1e3, 5)
        res = simulate(
            "qwen2.5-14b",
            1,
            "pla",
            "roofline-graph",
            "round_robin",
            [r for r in loop.first if r],
            loop.on_finish,
            pla_adaptive=False,
            pla_w_max_s=max(w, 0.001) / 1e3 if w else 1e-9,
            pla_t_max_s=1.0,
            pla_boundary_tokens=256,
        )
        m = metrics(res)
        print(
            f"| {w} | {m['rps']:.0f} | {1e3 * m['mean']:.1f} | {1e3 * m['p90']:.1f} | "
            f"{m['depth']:.1f} |",
            flush=True,
        )
    print()


# ---- Figure 6: closed-loop concurrency 1-64, four configurations ---------------------------
def fig6(args) -> dict:
    out = {}
    for replicas in args.replicas:
        for model in args.models:
            print(f"### Figure 6: {model}, {replicas} prefill instance(s), {args.shape}-shaped\n")
            configs = {**CONFIGS, **(TRACES if args.trace else {})}
            if replicas == 1:  # one instance: no routing (these are vanilla and full PLA)
                for name in ("vanilla, least work", "pla policy behind least work"):
                    configs.pop(name, None)
            print("| concurrency | " + " | ".join(f"{c} RPS / mean / P90" for c in configs) + " |")
            print("|---|" + "---|" * len(configs))
            for conc in args.concurrency:
                row = {}
                for name, (policy, pred, disp, extra) in configs.items():
                    shape = SHAREGPT if args.shape == "sharegpt" else LMSYS
                    sessions = Sessions(shape, 6, history=replicas == 1)
                    loop = ClosedLoop(sessions, conc, args.requests * replicas, 0.0, 6)
                    res = simulate(
                        model,
                        replicas,
                        policy,
                        pred,
                        disp if replicas > 1 else "round_robin",
                        [r for r in loop.first if r],
                        loop.on_finish,
                        **extra,
                    )
                    row[name] = metrics(res)
                out[replicas, model, conc] = row
                cells = [
                    f"{m['rps']:.1f} / {1e3 * m['mean']:.0f} / {1e3 * m['p90']:.0f}"
                    for m in row.values()
                ]
                print(f"| {conc} | " + " | ".join(cells) + " |", flush=True)
            best = max(
                (out[replicas, model, c] for c in args.concurrency),
                key=lambda r: r["full PLA"]["rps"] / r["vanilla"]["rps"],
            )
            top = out[replicas, model, args.concurrency[-1]]
            rows = [(c, out[replicas, model, c]) for c in args.concurrency]
            print(
                "\nshort-prefill (< 256 new tokens) mean TTFT, full PLA vs vanilla: "
                + ", ".join(
                    f"{c}: {pct(r['vanilla']['short_mean'], r['full PLA']['short_mean'])}"
                    for c, r in rows
                )
            )
            print(
                f"full PLA vs vanilla at concurrency {args.concurrency[-1]}: RPS "
                f"{pct(top['vanilla']['rps'], top['full PLA']['rps'])}, mean latency "
                f"{pct(top['vanilla']['mean'], top['full PLA']['mean'])}; best RPS gain over "
                f"the sweep {pct(best['vanilla']['rps'], best['full PLA']['rps'])}",
                flush=True,
            )
            if replicas > 1:
                print(
                    "full PLA vs vanilla routed by least work, RPS: "
                    + ", ".join(
                        f"{c}: {pct(r['vanilla, least work']['rps'], r['full PLA']['rps'])}"
                        for c, r in rows
                    )
                )
            print()
    return out


# ---- Figure 7: SLO violations, Poisson arrivals --------------------------------------------
FIG7 = {
    # name: (policy, predictor, dispatcher, chunking, cluster settings)
    "PLA-Serve": ("pla", "roofline-graph", "pla", CHUNK, {}),
    "SGLang (PD)": ("fcfs", "roofline-eager", "round_robin", CHUNK, {}),
    "SGLang (PD + router)": ("fcfs", "roofline-eager", "least_work", CHUNK, {}),
    "vLLM (PD)": ("fcfs", "roofline-eager", "round_robin", "static:2048", {}),
}
# --trace on 8 instances, from the router (fcfs, least work) to PLA-Serve one change at a time:
# graphs, then the pla policy on every instance (no pools), then the pools (PLA-Serve itself);
# and PLA-Serve with the pools from the start as the controller leaves them (6 long, 2 short)
FIG7_TRACES = {
    "router + graphs": ("fcfs", "roofline-graph", "least_work", CHUNK, {}),
    "router + graphs + pla policy": ("pla", "roofline-graph", "least_work", CHUNK, {}),
    "PLA-Serve, 6 long from the start": (
        "pla",
        "roofline-graph",
        "pla",
        CHUNK,
        {"pla_long_instances": 6},
    ),
}


def fig7(args) -> dict:
    out = {}
    model = args.fig7_model
    for replicas, rates in ((1, args.rates1), (8, args.rates8)):
        if replicas not in args.replicas:
            continue
        print(f"### Figure 7: SLO violations (TTFT > {SLO_S} s), {model}, {replicas} instance(s)\n")
        configs = {**FIG7, **(FIG7_TRACES if args.trace and replicas > 1 else {})}
        print("violations (short-prefill mean TTFT)\n")
        print("| rate (req/s) | " + " | ".join(configs) + " |")
        print("|---|" + "---|" * len(configs))
        for rate in rates:
            row = {}
            for name, (policy, pred, disp, chunk, extra) in configs.items():
                reqs = poisson(LMSYS, rate, args.requests * replicas, 7, replicas == 1)
                cluster = ClusterConfig.from_flat(
                    model=model,
                    hardware="h200",
                    predictor=pred,
                    replicas=replicas,
                    dispatcher=disp if replicas > 1 else "round_robin",
                    **extra,
                )
                config = SchedulerConfig(
                    policy=policy,
                    chunking=chunk,
                    prefix_cache="device" if replicas == 1 else "off",
                )
                row[name] = metrics(Simulator(cluster, ParallelConfig(), config).run(reqs))
            out[replicas, rate] = row
            print(
                f"| {rate:g} | "
                + " | ".join(
                    f"{100 * m['viol']:.1f}% ({1e3 * m['short_mean']:.0f} ms)" for m in row.values()
                )
                + " |",
                flush=True,
            )
        print()
    return out


# ---- Table 2: deadline-free distillation on 4 prefill instances ---------------------------
TABLE2 = {
    # name: (policy, predictor, dispatcher, scheduler settings)
    "SGLang": ("fcfs", "roofline-eager", "round_robin", {}),
    "SGLang, least work": ("fcfs", "roofline-eager", "least_work", {}),
    "PLA (token-max)": ("pla", "roofline-graph", "pla", {"pla_mode": "token-max"}),
}
TABLE2_TRACES = {
    "PLA, longs batched": (
        "pla",
        "roofline-graph",
        "pla",
        {"pla_mode": "token-max", "pla_long_batch": "all"},
    ),
    "PLA policy behind least_work": (
        "pla",
        "roofline-graph",
        "least_work",
        {"pla_mode": "token-max", "pla_long_batch": "all"},
    ),
    # the split the controller reaches, from the start: what the pools cost once balanced
    "PLA, 3 long from the start": (
        "pla",
        "roofline-graph",
        "pla",
        {"pla_mode": "token-max", "cluster": {"pla_long_instances": 3}},
    ),
    # n_min = 0: the short instance may join the long pool once the shorts are done
    "PLA, n_min 0": (
        "pla",
        "roofline-graph",
        "pla",
        {"pla_mode": "token-max", "cluster": {"pla_n_min": 0}},
    ),
    "PLA, n_min 0, longs batched": (
        "pla",
        "roofline-graph",
        "pla",
        {"pla_mode": "token-max", "pla_long_batch": "all", "cluster": {"pla_n_min": 0}},
    ),
}


def table2(args) -> dict:
    """Every request of the data set at t = 0 (offline distillation), token-max mode against
    fcfs; the prefill stage's makespan on 4 instances. The decode stage (4 instances, 1K tokens
    per request) is not simulated: its time is the same under both prefill schedulers."""
    out = {}
    configs = {**TABLE2, **(TABLE2_TRACES if args.trace else {})}
    print("### Table 2: distillation, 4 prefill instances, no deadlines (Qwen2.5-14B)\n")
    print("| data set | requests | " + " | ".join(f"{c} makespan" for c in configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    for name, shape in (("LMsys", LMSYS), ("ShareGPT", SHAREGPT)):
        spans = {}
        for sys_name, (policy, pred, disp, extra) in configs.items():
            reqs = [
                Request(f"r{i}", 0.0, r.prompt_len, 1)
                for i, r in enumerate(poisson(shape, 1.0, args.table2_requests, 9, False))
            ]
            res = simulate(
                "qwen2.5-14b", 4, policy, pred, disp, reqs, min_ttft_deadline_s=1e6, **extra
            )
            spans[sys_name] = metrics(res)["span"]
        out[name] = spans
        base = spans["SGLang"]  # the change in makespan (the paper's -7.3%: 7.3% shorter)
        cells = [f"{v:.1f} s ({100 * (v / base - 1):+.1f}%)" for v in spans.values()]
        print(f"| {name} | {args.table2_requests} | " + " | ".join(cells) + " |", flush=True)
    print()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", nargs="+", default=["fig5", "fig6", "fig7", "table2"])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--requests", type=int, default=1500, help="per instance, each run")
    ap.add_argument("--think-ms", type=float, default=20.0, help="Figure 5's client think time")
    ap.add_argument("--trace", action="store_true", help="Figure 6: the trace configurations too")
    ap.add_argument("--shape", default="sharegpt", choices=["sharegpt", "lmsys"])
    ap.add_argument("--fig7-model", default="qwen2.5-14b")
    ap.add_argument("--rates1", type=float, nargs="+", default=[10, 20, 30, 40])
    ap.add_argument("--rates8", type=float, nargs="+", default=[120, 200, 280])
    ap.add_argument("--table2-requests", type=int, default=20000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    for part in args.only:
        globals()[part](args)
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
