"""`medha plan`: the cheapest deployment that meets a trace's SLOs, found in the simulator."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from medha.cli.common import CliError

DESCRIPTION = """\
Search deployments for a trace in the simulator: device kind, tp x spp x kvp per replica,
replicas, scheduler, iteration budget, dispatcher, KV memory. Prints the cheapest deployment
that meets every SLO, the Pareto front of cost against each SLO metric, and the capacity of the
cheapest ones (the highest multiple of the trace's request rate they sustain within the SLOs).

Each axis comes from its flag (a comma-separated list) or from a YAML file (--space) of
axis: [values]; a flag given overrides the file. Pruned, not simulated: more replicas of a
deployment that already meets the SLOs, deployments over --budget, and every rate above one
where a deployment misses an SLO. Simulations run on Ray where it is installed (locally with no
set-up, or on a cluster with --ray-address), else on a process pool. Results stream into
OUT/points.jsonl; rerunning the same plan takes the points it finds there (--fresh ignores
them). Writes plan.json, plan.md, pareto.png and capacity.png to --out.

Example:
  medha plan --trace azure_conv --num-requests 10000 --model llama-3-8b \\
      --hardware h100,a100 --tp 1,2,4 --replicas 1,2,4,8 --schedulers lars,fcfs/none \\
      --slo ttft-p99=2,tpot-p99=0.1
"""

AXIS_FLAGS = {
    "hardware": ("--hardware", "device kinds, e.g. h100,a100 (default: h100)"),
    "tp": ("--tp", "tensor-parallel degrees (default: 1,2,4,8)"),
    "spp": ("--spp", "stream-pipeline stages (default: 1)"),
    "kvp": ("--kvp", "KV-cache parallel groups (default: 1)"),
    "replicas": ("--replicas", "replica counts (default: 1,2,4,8)"),
    "scheduler": (
        "--schedulers",
        "POLICY[/CHUNKING] each, e.g. lars,edf,fcfs/none,fcfs/static:512 (default: lars,fcfs/none)",
    ),
    "iteration_budget_s": (
        "--iteration-budget-s",
        "iteration budgets in seconds; 'default' for the scheduler's (default: default)",
    ),
    "dispatcher": (
        "--dispatchers",
        "round_robin, least_work, prefix, slack, pla: the classes `medha route --dispatcher` "
        "runs (default: round_robin)",
    ),
    "kv_memory_gb": (
        "--kv-memory-gb",
        "KV memory per device in GiB; 'default' for what the device has left (default: default)",
    ),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search the cheapest deployment that meets SLOs on a trace",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload and model (fixed for every simulation)")
    w.add_argument("--trace", required=True, help="a bundled trace name or a CSV/JSONL file")
    w.add_argument("--num-requests", type=int, default=None, help="requests of the trace to use")
    w.add_argument(
        "--qps", type=float, default=None, help="arrival rate for traces without timestamps"
    )
    w.add_argument(
        "--long-fraction",
        type=float,
        default=0.0,
        help="fraction of requests replaced by long-context ones drawn like Medha-SWE, as in "
        "medha simulate (default: 0)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--model", default="llama-3-8b", help="model spec (default: llama-3-8b)")
    w.add_argument("--predictor", default="roofline", help="batch-time model, as in medha simulate")
    w.add_argument(
        "--long-threshold",
        type=int,
        default=None,
        help="prompt tokens from which a request is long (for short-/long- SLOs)",
    )
    s = p.add_argument_group("search space")
    s.add_argument("--space", metavar="YAML", help="axes (and max_devices) from a YAML file")
    for key, (flag, text) in AXIS_FLAGS.items():
        s.add_argument(flag, dest=f"axis_{key}", metavar="LIST", default=None, help=text)
    s.add_argument("--max-devices", type=int, default=None, help="most devices per deployment")
    g = p.add_argument_group("goals and costs")
    g.add_argument(
        "--slo",
        required=True,
        help="targets in seconds: [short-|long-]METRIC-STAT=S, comma-separated, METRIC one of "
        "ttft, tpot, tbt, e2e and STAT one of p50, p90, p99, mean, max; e.g. "
        "ttft-p99=2,tpot-p99=0.1,short-ttft-p99=0.5",
    )
    g.add_argument("--budget", type=float, default=None, help="most US$ per hour to consider")
    g.add_argument(
        "--prices",
        default=None,
        help="US$ per device-hour, KIND=PRICE comma-separated, over the defaults "
        "(a100=3, h100=5, h200=6.5, cpu=0.1: illustrative, set your own)",
    )
    g.add_argument(
        "--capacity-top",
        type=int,
        default=3,
        help="search the capacity of the this many cheapest deployments that meet the SLOs "
        "(default: 3; 0 skips it)",
    )
    g.add_argument("--max-rate", type=float, default=64.0, help="highest rate multiple tried")
    g.add_argument(
        "--capacity-steps", type=int, default=5, help="bisection steps of the capacity search"
    )
    r = p.add_argument_group("running")
    r.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "ray", "processes", "serial"),
        help="where simulations run (default: ray if installed, else a process pool)",
    )
    r.add_argument(
        "--workers", type=int, default=None, help="parallel simulations (default: cores)"
    )
    r.add_argument(
        "--ray-address", default=None, help="a running Ray cluster, e.g. auto or ray://h:10001"
    )
    r.add_argument("--out", default="plan-out", help="output directory (default: plan-out)")
    r.add_argument("--fresh", action="store_true", help="ignore the results of an earlier run")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def build_space(args):
    from medha.plan.space import SearchSpace, SpaceError, parse_list

    data: dict = {}
    if args.space:
        import yaml

        try:
            data = yaml.safe_load(Path(args.space).read_text()) or {}
        except OSError as e:
            raise CliError(f"--space {args.space}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise CliError(f"--space {args.space}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise CliError(f"--space {args.space}: expected a mapping of axis names to lists")
    for key in AXIS_FLAGS:
        value = getattr(args, f"axis_{key}")
        if value is not None:
            data[key] = parse_list(value)
    if args.max_devices is not None:
        data["max_devices"] = args.max_devices
    try:
        return SearchSpace.from_mapping(data)
    except SpaceError as e:
        raise CliError(f"search space: {e}") from None


def run(args: argparse.Namespace) -> None:
    from medha.plan import report
    from medha.plan.cost import cost_per_hour, parse_prices
    from medha.plan.search import (
        ChainLog,
        Fixed,
        Runner,
        capacity_chain,
        make_backend,
        meets,
        point_key,
        replicas_chain,
    )
    from medha.plan.slo import parse_slos

    try:
        slos = parse_slos(args.slo)
        prices = parse_prices(args.prices)
    except ValueError as e:
        raise CliError(str(e)) from None
    space = build_space(args)
    missing = sorted({hw for hw in space.axes["hardware"]} - prices.keys())
    if missing:
        raise CliError(f"--prices: no price for {', '.join(missing)}")
    for name, value, low in (
        ("--budget", args.budget, 0),
        ("--max-rate", args.max_rate, 1),
        ("--workers", args.workers, 1),
    ):
        if value is not None and not (value >= low and math.isfinite(value)):
            raise CliError(f"{name}: {value!r} must be a number >= {low}")
    if args.capacity_top < 0 or args.capacity_steps < 0:
        raise CliError("--capacity-top and --capacity-steps must be >= 0")
    fixed = Fixed(
        model=args.model,
        trace=args.trace,
        num_requests=args.num_requests,
        qps=args.qps,
        long_fraction=args.long_fraction,
        seed=args.seed,
        predictor=args.predictor,
        long_threshold=args.long_threshold,
    )
    num_requests = _check_workload(fixed)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    results = out / "points.jsonl"
    if args.fresh and results.exists():
        results.unlink()

    ok = lambda result: meets(result, slos)  # noqa: E731
    cost = lambda point: cost_per_hour(point, prices)  # noqa: E731
    chains = space.chains()
    too_big = space.grid_size - sum(len(c) for c in chains)
    logs = [ChainLog([]) for _ in chains]
    try:
        backend = make_backend(args.backend, args.workers, args.ray_address)
    except (ValueError, ImportError) as e:
        raise CliError(f"--backend {args.backend}: {e}") from None
    print(
        f"plan: {space.grid_size} deployments in the grid, {num_requests} requests of "
        f"{args.trace}, {len(slos)} SLO(s); {backend.workers} worker(s) on {backend.name}",
        file=sys.stderr,
    )
    progress = None
    if not args.quiet:
        from tqdm import tqdm

        progress = tqdm(desc="simulations", unit="sim", file=sys.stderr)
    runner = Runner(fixed, backend, results, progress)
    try:
        runner.run([replicas_chain(c, ok, args.budget, cost, log) for c, log in zip(chains, logs)])
        evaluated = [pr for log in logs for pr in log.simulated]
        unique = {point_key(p): (p, r) for p, r in reversed(evaluated)}  # the first of each
        rows = report.rows(list(unique.values()), slos, prices)
        feasible = [r for r in rows if r["meets"]]
        # capacity of the cheapest few that meet the SLOs, in parallel
        cap_logs = {r["label"]: ChainLog([]) for r in feasible[: args.capacity_top]}
        runner.run(
            [
                capacity_chain(
                    r["point"], ok, cap_logs[r["label"]], args.max_rate, args.capacity_steps
                )
                for r in feasible[: args.capacity_top]
            ]
        )
    finally:
        if progress is not None:
            progress.close()
        backend.close()

    capacity = {name: log.capacity for name, log in cap_logs.items()}
    capacity_text = {  # what the table and the summary print
        name: ("at least " if log.capacity_capped else "") + f"{log.capacity:.3g}x"
        for name, log in cap_logs.items()
    }
    fronts = {s.name: report.pareto(rows, s) for s in slos}
    counts = {
        "grid": space.grid_size,
        "simulated_grid_points": len(rows),
        "same_as_another_point": len(evaluated) - len(rows),
        "pruned_more_replicas_than_needed": sum(log.pruned_dominated for log in logs),
        "pruned_over_budget": sum(log.pruned_budget for log in logs),
        "pruned_cannot_run": sum(log.pruned_invalid for log in logs),
        "pruned_over_max_devices": too_big,
        "capacity_simulations": sum(len(log.simulated) for log in cap_logs.values()),
        "simulations_run": runner.simulated,
        "simulations_reused": runner.reused,
    }
    best = feasible[0] if feasible else None
    plan = {
        "fixed": fixed.__dict__,
        "slos": {s.name: s.target_s for s in slos},
        "prices": prices,
        "space": {**space.axes, "max_devices": space.max_devices},
        "counts": counts,
        "best": None if best is None else {**best, "capacity": capacity.get(best["label"])},
        "infeasible": None if best else report.infeasible(rows, slos),
        "pareto": {name: [r["label"] for r in front] for name, front in fronts.items()},
        "capacity": {
            name: {
                "capacity": log.capacity,
                "at_least": log.capacity_capped,
                "curve": [
                    {"rate": p["rate"], "meets": ok(res), **_curve_point(res, slos)}
                    for p, res in log.simulated
                ],
            }
            for name, log in cap_logs.items()
        },
        "deployments": rows,
    }
    (out / "plan.json").write_text(json.dumps(_finite(plan), indent=1, allow_nan=False))
    table = report.markdown(rows, slos, capacity_text)
    text = _summary(plan, slos, counts, best, capacity_text) + "\n" + table
    (out / "plan.md").write_text(text)
    if not args.no_plots:
        at_1x = {report.label(p): ({**p, "rate": 1.0}, r) for p, r in unique.values()}
        curves = {
            name: _capacity_curve([at_1x[name], *log.simulated], slos)
            for name, log in cap_logs.items()
        }
        report.plot(out, rows, slos, fronts, curves)
    print(text)
    print(f"results in {out}/")


def _check_workload(fixed) -> int:
    """The trace reads and has what the plan needs, before any worker starts."""
    from medha.sim.workload.generator import build_requests
    from medha.sim.workload.traces import TraceError

    try:
        return len(build_requests(fixed.workload(), max_context=1 << 30))
    except (TraceError, ValueError, OSError) as e:
        raise CliError(f"--trace {fixed.trace}: {e}") from None


def _devices(n: int) -> str:
    return f"{n} device" + ("s" if n != 1 else "")


def _curve_point(result: dict, slos) -> dict:
    if "error" in result:
        return {"error": result["error"]}
    return {s.name: s.value(result) for s in slos} | {
        "slo_attainment": result.get("slo_attainment")
    }


def _capacity_curve(points: list[tuple[dict, dict]], slos) -> list[tuple[float, float, float]]:
    """(rate, worst SLO metric / target, SLO attainment) of each simulation that ran."""
    from medha.plan.report import worst_over_target

    return [
        (p["rate"], worst_over_target(_curve_point(r, slos), slos), r.get("slo_attainment"))
        for p, r in points
        if "error" not in r
    ]


def _finite(o):
    """JSON has no inf: a metric no request reported (inf, never met) is written as null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _summary(plan: dict, slos, counts: dict, best, capacity: dict) -> str:
    c = counts
    saved = c["grid"] - c["simulated_grid_points"]
    lines = [
        f"# medha plan: {plan['fixed']['trace']}, {plan['fixed']['model']}, "
        + ", ".join(f"{s.name} <= {s.target_s:g} s" for s in slos),
        "",
        f"Grid: {c['grid']} deployments; simulated {c['simulated_grid_points']}, saved "
        f"{saved} ({saved / c['grid']:.0%}): {c['pruned_more_replicas_than_needed']} with more "
        f"replicas than needed, {c['pruned_over_budget']} over budget, "
        f"{c['pruned_cannot_run']} that cannot run, {c['pruned_over_max_devices']} over max "
        f"devices, {c['same_as_another_point']} the same as another (one replica: every "
        f"dispatcher alike). Capacity search: {c['capacity_simulations']} simulations. "
        f"{c['simulations_run']} simulations run, {c['simulations_reused']} taken from an "
        "earlier run or another point.",
        "",
    ]
    if best is not None:
        cap = capacity.get(best["label"])
        lines.append(
            f"Cheapest that meets every SLO: **{best['label']}** ({_devices(best['devices'])}, "
            f"US$ {best['cost_per_hour']:.2f}/h): "
            + ", ".join(f"{k} {v:.3g} s" for k, v in best["metrics"].items())
            + (f"; capacity {cap} the trace's rate" if cap else "")
            + "."
        )
        point = best["point"]
        if point["replicas"] > 1:  # the dispatcher the router runs as the simulation did
            lines.append(
                f"Route its {point['replicas']} replicas with `medha route --dispatcher "
                f"{point['dispatcher']} --replica URL ...` (the same dispatcher class)."
            )
    else:
        inf = plan["infeasible"]
        lines.append("No deployment meets every SLO.")
        for name, d in inf["per_slo"].items():
            lines.append(
                f"- {name} <= {d['target_s']:g} s: best {d['best_s']:.3g} s "
                + (
                    "(met by some deployment)"
                    if d["met_by_some"]
                    else f"({d['miss_factor']:.2f}x the target) by {d['closest']}"
                )
            )
        if inf["closest"]:
            lines.append(
                f"Closest to meeting all: {inf['closest']['label']} (worst metric "
                f"{inf['closest']['worst_value_over_target']:.2f}x its target)."
            )
    return "\n".join(lines) + "\n"
