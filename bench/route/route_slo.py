"""Routers in front of two `medha serve` replicas: TTFT SLO attainment, prefix hits, hot spots.

    python bench/route/route_slo.py [--contenders all]
        [--workloads multi_turn,shared_prefix,mixed,sharegpt] [--rounds 1] [--qps 0.5]
        [--num-requests 20] [--install-peers] [--out runs/route_slo]

Contenders (medha/benchmark/routers.py): `medha route` with each dispatcher (medha-slack,
medha-round_robin, medha-least_work, medha-prefix, medha-pla), SGLang's router with
cache_aware, vLLM's router with cache_aware and with consistent_hash. A peer that is not
installed is reported as "skipped: <why>" (--install-peers installs both into their own
virtual environment first). One contender runs at a time, in the order
`local_server.alternated` gives (flipped every round: a 2-core machine drifts over minutes),
and every (round, contender, workload) gets two freshly started replicas, `medha serve
--prefix-cache device` bound to one core each (taskset -c 0, -c 1), and a fresh router: every
contender starts with empty prefix caches, zeroed counters and an empty routing state.

Workloads, all real text through the OpenAI API, streamed:

- multi_turn: conversations as `medha trace generate` builds them (ConversationTraceConfig:
  a few system prompts shared by most conversations, geometric turn counts, log-normal user
  messages, answers and think times), sized for SmolLM2 on one core per replica (--multi-turn
  changes any field). Each turn goes to /v1/chat/completions with the whole history: the
  system prompt, every earlier user message and the answer the server actually gave, then the
  new message; so prompts share the system prompt's text across conversations and the
  conversation's own history across turns, which is what a prefix-aware router can exploit.
  Conversations start at Poisson times (rate --qps / mean turns, so about --qps requests a
  second) and each runs closed-loop: the next turn leaves a think time after the previous
  answer ended. Replaying the trace's timestamps open-loop would not be faithful here: its
  turn times assume 30 ms a token, and a turn sent before the previous answer has arrived
  could not contain it. Every turn carries X-Session-ID: its conversation (the key
  vllm-router's consistent_hash is documented to take; the others ignore it).
- shared_prefix: questions about documents (SHARED_PREFIX: 8 documents of 512 tokens, Zipf
  popularity with exponent 1, so the first draws 37% of the requests; questions of 16-64
  tokens, 16-48 output tokens), Poisson at --qps, to /v1/completions. The trace is medha's own
  (a document-QA service): the hot document is what pulls a cache-aware router onto one
  replica.
- mixed: bench/server/server_mixed_load.py's mix (95% prompts of 32-256 tokens, 5% of 3,000-6,000,
  16-48 output tokens), Poisson at --qps, lengths and arrival times from `medha bench`'s
  build_requests, random words to /v1/completions.
- sharegpt: the control with little sharing: lengths from the bundled ShareGPT trace (Llama-2
  tokenizer counts), prompts clipped to --sharegpt-max-prompt and outputs to
  --sharegpt-max-output tokens (its median prompt of 1,730 tokens and answer of 415 would
  take ~8 s and ~25 s on one of these cores: the clipped mix keeps the replicas below
  saturation at the smoke rate), Poisson at --qps, random words to /v1/completions.

Every request asks for exactly its output length (ignore_eos, temperature 0). Prompts are
words that SmolLM2 tokenizes one token each (the calibration checks it), so the client knows a
prompt's length before sending it.

The TTFT target of each request is medha's default deadline, max(1.5 x its isolated prefill
time, 0.5 s), the one a medha replica gives a request that names none; here "isolated prefill
time" is measured, not predicted: before the first contender, one replica (one core, as in the
runs) answers prompts of 16 to 2,048 tokens alone, and the time to first token through HTTP is
fitted with a + b L + c L^2 (non-negative terms) over the prompt length L (the whole prompt:
the target does not shrink with a cache hit, so a router that lands a turn on the replica
holding its history meets the target with room to spare, and one that does not pays the full
prefill). The measured time is what a client sees of a lone request on this machine; medha's
own profile was taken on both cores and would make every target ~2x too tight for one core.
--ttft-slo-s sets one fixed target instead. Each request carries its target as
`medha: {"ttft_slo_s": ...}` in the body (the replica's deadline; SGLang's router drops it on
chat requests, see routers.py, and the replica then applies its default, the same formula
over its own prediction) and as the header x-slo-ttft-ms (for a router that reads it).

Reported per contender and workload (pooled over rounds): short-request TTFT p50/p99 (prompt
below 1,024 tokens, server_mixed_load's long threshold), SLO attainment (share of requests
with a first token within target; failures count as misses) and misses, the cluster's prefix
hit rate (prefix_cache_hits_tokens over prefix_cache_queries_tokens, both replicas' /metrics,
read before and after the run), the hot-spot index (replicas x the busiest replica's share of
the requests, from each replica's medha_requests_total; 1.0 is perfectly even, 2.0 all on
one; and the same over the prefill work, the prompt tokens each replica's cache missed: a
router that keeps long conversations on one replica and sends the many short ones to the
other is even by work and not by count), the router's CPU time a request (on this machine
taken from the replicas' cores), throughput (completed requests and output tokens a second of
wall time), the three slowest short requests (what they met: cached tokens, requests in flight
at their send) and the short p99 no router can beat on the run (each cell's first request,
sent to idle replicas with empty caches, at its isolated TTFT). The JSON at
--out/summary.json holds every round, every request and the calibration; --report PATH prints
a stored run's tables again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

from medha.benchmark.harness import add_common_args
from medha.benchmark.local_server import alternated
from medha.benchmark.route_calibration import calibrate
from medha.benchmark.route_client import Slo, run_workload
from medha.benchmark.route_probes import (
    replica_counters,
    replica_kv_tokens,
    router_measures,
    served_model,
    slo_field_forwarded,
)

# summarize, slowest_short and short_p99_floor are read here by tests/test_route_contenders.py
from medha.benchmark.route_report import (  # noqa: F401
    fmt,
    print_tables,
    report,
    short_p99_floor,
    slowest_short,
    summarize,
    tables,
)
from medha.benchmark.route_twin import one_cache_hit_rate, twin_trace, twins
from medha.benchmark.route_workloads import (
    MIXED,
    MULTI_TURN,
    WORKLOADS,
    conversations,
    one_shots,
)
from medha.benchmark.routers import (
    CONTENDERS,
    Missing,
    check_installed,
    contender,
    cpu_seconds,
    install_peers,
    running_router,
    serving_replicas,
)
from medha.sim.workload.prefix_trace import ConversationTraceConfig

# --- one cell: fresh replicas, a router, a workload ------------------------------------------


def run_cell(name: str, workload: str, args, slo: Slo, calib: dict, log) -> dict:
    flags = ["--prefix-cache", "device", *args.replica_flags.split()]
    router_flags = []
    if args.profile:  # replicas and router plan with the same (one-core) profile
        flags += ["--predictor", f"profiled:{args.profile}"]
        router_flags += ["--predictor", f"profiled:{args.profile}"]
    with serving_replicas(2, flags, pin=not args.no_pin, log=log) as replicas:
        model = served_model(replicas[0])
        kv_tokens = replica_kv_tokens(replicas[0])
        t = time.perf_counter()
        with running_router(name, replicas, log=log, medha_flags=router_flags) as (
            base,
            cmd,
            pid,
        ):
            startup = time.perf_counter() - t
            forwarded = slo_field_forwarded(base, model)
            before = [replica_counters(u) for u in replicas]
            if workload == "multi_turn":
                cfg = ConversationTraceConfig(**(MULTI_TURN | args.multi_turn))
                load = conversations(cfg, args.num_requests, args.qps, args.seed)
            else:
                load = one_shots(workload, args)
            cpu = cpu_seconds(pid)
            results, wall = asyncio.run(run_workload(base, model, load, slo, calib["chat"]))
            cpu = cpu_seconds(pid) - cpu
            after = [replica_counters(u) for u in replicas]
            measures = router_measures(base) if name.startswith("medha-") else {}
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    twin = twin_trace(results)
    trace = Path(args.out) / f"twin-{name}-{workload}-{args.seed}-{time.time_ns()}.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in twin))
    return {
        "twin_trace": str(trace),
        "kv_tokens_per_replica": kv_tokens,
        "one_cache_hit_rate": one_cache_hit_rate(twin, 2 * kv_tokens),
        "contender": name,
        "workload": workload,
        "router_command": cmd,
        "router_startup_s": startup,
        "slo_field_forwarded": forwarded,
        "wall_s": wall,
        # the router's CPU seconds over the workload: taken from the replicas' two cores
        "router_cpu_s": cpu,
        "replicas": delta,
        # each replica's speed, as medha route measured it at the end; its prediction error
        # and the picks that error changed
        "router_slowdowns": measures.get("slowdowns"),
        "router_prediction_error_s": measures.get("prediction_error_s"),
        "router_tie_breaks": measures.get("tie_breaks"),
        "requests": [asdict(r) | {"text": None, "payload": None} for r in results],
    }


# --- main ------------------------------------------------------------------------------------


def _kv(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in MULTI_TURN:
            raise argparse.ArgumentTypeError(f"--multi-turn: unknown key {key!r}")
        out[key] = type(MULTI_TURN[key])(value)
    return out


def parser() -> argparse.ArgumentParser:
    """The flags; --help prints the module's docstring before them."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contenders", default="all", help=f"comma-separated, or all: {CONTENDERS}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--qps", type=float, default=0.5, help="requests a second (default 0.5)")
    # the shared flags one at a time, so that --help lists them where it always has
    add_common_args(ap, num_requests=20, num_requests_help="per workload")
    add_common_args(ap, seed=0)
    ap.add_argument(
        "--multi-turn",
        type=_kv,
        default={},
        help=f"ConversationTraceConfig fields, k=v,...: {MULTI_TURN}",
    )
    ap.add_argument("--sharegpt-max-prompt", type=int, default=512)
    ap.add_argument("--sharegpt-max-output", type=int, default=64)
    ap.add_argument("--ttft-slo-s", type=float, default=None, help="one fixed TTFT target")
    ap.add_argument(
        "--calibration", default=None, help="reuse the calibration of an earlier summary.json"
    )
    ap.add_argument("--replica-flags", default="", help="more `medha serve` flags, one string")
    ap.add_argument("--no-pin", action="store_true", help="no taskset: replicas share the cores")
    ap.add_argument("--install-peers", action="store_true", help="pip-install the peer routers")
    ap.add_argument(
        "--profile",
        default=None,
        help="a profile of one replica's core (`taskset -c 0 medha profile --out PATH`): the "
        "replicas and medha's router plan with it, and the digital twin replays each medha "
        "contender's run in `medha simulate` with it",
    )
    add_common_args(ap, out="runs/route_slo", out_help="where the run's files go")
    ap.add_argument(
        "--report",
        metavar="SUMMARY",
        default=None,
        help="print the tables of an earlier run's summary.json again (its summaries "
        "recomputed from its cells) and run nothing",
    )
    return ap


def run_cells(names: list[str], workloads: list[str], args, out: Path) -> tuple[dict, list]:
    """The calibration (or an earlier run's), then every round's cells of the contenders
    `names` in alternated order, each kept in out/cells.json as it ends: (calibration, cells)."""
    with open(out / "servers.log", "a") as log:
        if args.calibration:
            calib = json.loads(Path(args.calibration).read_text())["calibration"]
        else:
            calib = calibrate(args, log)
            (out / "calibration.json").write_text(json.dumps({"calibration": calib}))
        a, b, c = calib["fit"]
        print(
            f"isolated TTFT(L) = {a:.3f} + {b * 1e3:.3f} ms x L + {c * 1e6:.4f} us x L^2; "
            f"{calib['tokens_per_word']:.2f} tokens a word"
        )
        slo = Slo(calib, args.ttft_slo_s)
        cells: list[dict] = []
        for rnd, name in alternated(names, args.rounds):
            for workload in workloads:
                t = time.perf_counter()
                cell = run_cell(name, workload, args, slo, calib, log)
                cell["round"] = rnd
                cells.append(cell)
                # every cell kept as it ends: a later failure loses none
                (out / "cells.json").write_text(json.dumps(cells, indent=1))
                s = summarize([cell])
                print(
                    f"round {rnd} {name} {workload}: {s['requests']} requests, "
                    f"{s['errors']} errors, SLO {fmt(s['slo_attainment'], '.0%')}, "
                    f"hits {fmt(s['prefix_hit_rate'], '.0%')}, "
                    f"hot spot {fmt(s['hot_spot_index'], '.2f')}, router CPU "
                    f"{fmt(s['router_cpu_s_per_request'], '.4f')} s a request, router up in "
                    f"{cell['router_startup_s']:.1f} s ({time.perf_counter() - t:.0f} s)"
                )
    return calib, cells


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.report:
        return report(Path(args.report))
    names = CONTENDERS if args.contenders == "all" else args.contenders.split(",")
    for name in names:
        try:
            contender(name)
        except ValueError as e:
            ap.error(str(e))
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.install_peers:
        print(f"peers installed in {install_peers()}")
    skipped: dict[str, str] = {}
    for name in names:
        try:
            check_installed(name)
        except Missing as e:
            skipped[name] = str(e)
            print(f"{name}: skipped: {e}")
    if len(skipped) == len(names):
        return
    ran = [n for n in names if n not in skipped]
    calib, cells = run_cells(ran, workloads, args, out)
    table = tables(cells, ran, workloads, calib)
    summary = {
        "config": {k: v for k, v in vars(args).items()}
        | {"multi_turn_config": MULTI_TURN | args.multi_turn, "mixed": MIXED},
        "calibration": calib,
        "skipped": skipped,
        "summary": table,
        "cells": cells,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_tables(table, skipped, args)
    if args.profile:
        summary["twin"] = twins(cells, args.profile)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.profile:
        print("\n| contender | workload | round | short TTFT p50 measured | simulated | error |")
        print("|---|---|---|---|---|---|")
        for t in summary["twin"]:
            print(
                f"| {t['contender']} | {t['workload']} | {t['round']} | "
                f"{t['measured_s']:.3f} s | {t['simulated_s']:.3f} s | {t['error']:+.0%} |"
            )
    print(f"\n{out / 'summary.json'}")


if __name__ == "__main__":
    main()
