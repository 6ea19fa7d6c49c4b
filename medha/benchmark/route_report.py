"""bench/route/route_slo.py's results: one contender's cells of one workload pooled into a summary
(short-request TTFT percentiles, SLO attainment, prefix hit rate, hot-spot index, the router's
CPU time, throughput, the slowest short requests and the short p99 no router can beat), the
summaries of a whole run (`tables`), and their Markdown tables (`print_tables`; `report` prints
a stored run's again).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from medha.benchmark.harness import percentile

# a short request's prompt is below this many tokens (server_mixed_load's long threshold)
LONG_THRESHOLD = 1024


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _length(r: dict) -> int:
    return r["prompt_tokens"] if r["prompt_tokens"] is not None else r["est_prompt_tokens"]


def slowest_short(cells: list[dict], k: int = 3) -> list[dict]:
    """The k slowest short requests (the ones a p99 over a few hundred is made of), each with
    what it met: its prompt, what the replica had cached of it, and how many requests of its
    cell were in flight (sent, not yet ended) when it was sent."""
    rows = []
    for c in cells:
        ok = [r for r in c["requests"] if r["status"] == "ok"]
        for r in ok:
            if _length(r) >= LONG_THRESHOLD:
                continue
            busy = sum(
                q is not r and q["sent_s"] <= r["sent_s"] < q["sent_s"] + q["e2e_s"] for q in ok
            )
            rows.append(
                {"round": c.get("round"), "index": r["index"], "turn": r["turn"],
                 "prompt_tokens": _length(r), "cached_tokens": r["cached_tokens"],
                 "in_flight": busy, "ttft_s": r["ttft_s"]}
            )  # fmt: skip
    return sorted(rows, key=lambda r: -r["ttft_s"])[:k]


def short_p99_floor(cells: list[dict], fit: list[float]) -> float | None:
    """A short-TTFT p99 no router can beat on these cells: every cell starts with idle replicas
    and empty caches, so its first request takes at least its isolated TTFT (the calibration's
    fit) whatever the router does; the p99 over the shorts with that for each cell's first
    request and 0 for every other."""
    a, b, c = fit
    floors = []
    for cell in cells:
        ok = [r for r in cell["requests"] if r["status"] == "ok"]
        short = [r for r in ok if _length(r) < LONG_THRESHOLD]
        sent = [r for r in cell["requests"] if r["status"] != "not sent"]
        first = min(sent, key=lambda r: r["sent_s"], default=None)
        for r in short:
            n = _length(r)
            floors.append(a + b * n + c * n * n if r is first else 0.0)
    return percentile(floors, 99)


def summarize(cells: list[dict], fit: list[float] | None = None) -> dict:
    """One contender's rounds of one workload, pooled: percentiles and attainment over every
    request, hit rate over the summed counters, hot-spot index and throughput averaged over
    rounds; with the calibration's `fit`, the short p99's floor."""
    reqs = [r for c in cells for r in c["requests"]]
    ok = [r for r in reqs if r["status"] == "ok"]
    short = [r["ttft_s"] for r in ok if _length(r) < LONG_THRESHOLD]
    met = sum(1 for r in ok if r["ttft_s"] <= r["target_s"])
    queries = sum(d["prefix_queries"] for c in cells for d in c["replicas"])
    hits = sum(d["prefix_hits"] for c in cells for d in c["replicas"])
    hot, hot_work = [], []
    for c in cells:
        counts = [d["requests"] for d in c["replicas"]]
        if sum(counts):
            hot.append(len(counts) * max(counts) / sum(counts))
        # the same over the prefill work each replica did: the prompt tokens its cache missed
        work = [d["prefix_queries"] - d["prefix_hits"] for d in c["replicas"]]
        if sum(work) > 0:
            hot_work.append(len(work) * max(work) / sum(work))
    # how far the router's predicted TTFT was from the measured one, per request (its own
    # clock starts when it has read the request, the client's when it sends it: a few ms)
    predicted = [r for r in ok if r.get("predicted_ttft_s") is not None]
    misses = [r["ttft_s"] - r["predicted_ttft_s"] for r in predicted]
    return {
        "requests": len(reqs),
        "errors": len(reqs) - len(ok),
        "predicted": len(predicted),
        "predicted_ttft_abs_error_p50_s": percentile([abs(m) for m in misses], 50),
        "predicted_ttft_error_p50_s": percentile(misses, 50),  # measured - predicted: + is late
        "short": len(short),
        "short_ttft_p50_s": percentile(short, 50),
        "short_ttft_p99_s": percentile(short, 99),
        "short_ttft_p99_floor_s": short_p99_floor(cells, fit) if fit else None,
        "short_ttft_slowest": slowest_short(cells),
        "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 50),
        "slo_attainment": met / len(reqs) if reqs else None,
        "slo_misses": len(reqs) - met,
        "prefix_hit_rate": hits / queries if queries else None,
        "hot_spot_index": float(np.mean(hot)) if hot else None,
        "hot_spot_index_work": float(np.mean(hot_work)) if hot_work else None,
        "one_cache_hit_rate": _mean([c.get("one_cache_hit_rate") for c in cells]),
        "per_replica_requests": [[d["requests"] for d in c["replicas"]] for c in cells],
        "router_slowdowns": [c.get("router_slowdowns") for c in cells],
        "router_tie_breaks": [c.get("router_tie_breaks") for c in cells],
        "router_cpu_s_per_request": _mean(
            [
                c["router_cpu_s"] / len(c["requests"])
                for c in cells
                if c.get("router_cpu_s") is not None
            ]
        ),
        "requests_per_s": float(
            np.mean([sum(r["status"] == "ok" for r in c["requests"]) / c["wall_s"] for c in cells])
        ),
        "output_tokens_per_s": float(
            np.mean(
                [
                    sum(r["completion_tokens"] or 0 for r in c["requests"]) / c["wall_s"]
                    for c in cells
                ]
            )
        ),
        "slo_field_forwarded": cells[0]["slo_field_forwarded"],
    }


def tables(cells: list[dict], names: list[str], workloads: list[str], calib: dict) -> dict:
    """Each workload's summary of each contender, pooled over rounds."""
    return {
        w: {
            n: summarize(
                [c for c in cells if c["contender"] == n and c["workload"] == w], calib["fit"]
            )
            for n in names
        }
        for w in workloads
    }


def report(path: Path) -> None:
    """An earlier run's tables again, from its summary.json."""
    summary = json.loads(path.read_text())
    cells = summary["cells"]
    names = list(dict.fromkeys(c["contender"] for c in cells))
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    config = argparse.Namespace(**summary["config"])
    print_tables(
        tables(cells, names, workloads, summary["calibration"]), summary["skipped"], config
    )


def fmt(x, spec):
    """`x` formatted by `spec`, "-" where there is none."""
    return "-" if x is None else format(x, spec)


def print_tables(table: dict, skipped: dict, args) -> None:
    """Each workload's table of contenders, then what each router measured and its slowest
    short requests, then the contenders skipped and why."""
    for w, rows in table.items():
        print(f"\n{w}: {args.num_requests} requests x {args.rounds} rounds, {args.qps} req/s\n")
        print(
            "| contender | short TTFT p50 | short TTFT p99 | SLO met | misses | prefix hits "
            "(one cache) | hot spot: requests / prefill work | req/s | out tok/s | errors |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, s in rows.items():
            print(
                f"| {name} | {fmt(s['short_ttft_p50_s'], '.3f')} s | "
                f"{fmt(s['short_ttft_p99_s'], '.3f')} s | {fmt(s['slo_attainment'], '.0%')} | "
                f"{s['slo_misses']} | {fmt(s['prefix_hit_rate'], '.1%')} "
                f"({fmt(s['one_cache_hit_rate'], '.1%')}) | "
                f"{fmt(s['hot_spot_index'], '.2f')} / {fmt(s['hot_spot_index_work'], '.2f')} | "
                f"{s['requests_per_s']:.3f} | "
                f"{s['output_tokens_per_s']:.1f} | {s['errors']} |"
            )
        for name, s in rows.items():
            if s.get("router_cpu_s_per_request") is not None:
                print(
                    f"{name}: the router's CPU time, {1e3 * s['router_cpu_s_per_request']:.1f} ms "
                    "a request (taken from the replicas' cores unless they are pinned apart)"
                )
            if s.get("predicted"):
                print(
                    f"{name}: predicted TTFT against measured over {s['predicted']} requests: "
                    f"median |error| {s['predicted_ttft_abs_error_p50_s']:.3f} s, median "
                    f"measured - predicted {s['predicted_ttft_error_p50_s']:+.3f} s"
                )
            if any(s.get("router_slowdowns") or ()):
                speeds = "; ".join(
                    ", ".join(f"{x:.2f}" for x in cell) for cell in s["router_slowdowns"] if cell
                )
                print(f"{name}: each replica's slowdown at the end, by round: {speeds}")
            if any(n is not None for n in s.get("router_tie_breaks") or ()):
                ties = s["router_tie_breaks"]
                print(f"{name}: picks its prediction error changed, by round: {ties}")
            slowest = "; ".join(
                f"{r['ttft_s']:.3f} s (round {r['round']}, #{r['index']}"
                + ("" if r["turn"] is None else f" turn {r['turn']}")
                + f", {r['prompt_tokens']} tokens, {r['cached_tokens']} cached, "
                f"{r['in_flight']} in flight)"
                for r in s.get("short_ttft_slowest") or ()
            )
            if slowest:
                print(f"{name}: the slowest short requests: {slowest}")
        # (0 where the cells' first requests are too few to reach the p99)
        floors = {
            round(s["short_ttft_p99_floor_s"], 3)
            for s in rows.values()
            if s.get("short_ttft_p99_floor_s")
        }
        if floors:
            print(
                f"short TTFT p99 no router can beat here (each cell's first request, sent to "
                f"idle replicas with empty caches, at its isolated TTFT): "
                f"{' / '.join(f'{f:.3f} s' for f in sorted(floors))}"
            )
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}")
