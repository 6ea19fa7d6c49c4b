"""One plan from its inputs to its files: the replica chains over the grid, the capacity of the
cheapest deployments that meet the SLOs, and plan.json, plan.md and the plots written from
them. `medha plan` parses its flags into these inputs, calls them and prints the answer."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from medha.plan import report
from medha.plan.cost import cost_per_hour
from medha.plan.search import (
    Backend,
    ChainLog,
    Fixed,
    Result,
    Runner,
    capacity_chain,
    meets,
    point_key,
    replicas_chain,
)
from medha.plan.slo import Slo
from medha.plan.space import SearchSpace


@dataclass
class Searched:
    """What the search ran and skipped: the grid's chains, then the capacity chains."""

    logs: list[ChainLog]  # one per replica chain of the grid
    cap_logs: dict[str, ChainLog]  # label -> the capacity chain of each of the cheapest
    evaluated: list[tuple[dict, Result]]  # every grid point simulated, in chain order
    unique: dict[str, tuple[dict, Result]]  # point_key -> the first of each distinct point
    rows: list[dict]  # report.rows of the distinct points, cheapest first
    fronts: dict[str, list[dict]]  # SLO name -> its Pareto front of the rows
    too_big: int  # grid points over max_devices, never chained
    simulated: int  # simulations the runner ran
    reused: int  # ... and took from the results file or another chain

    @property
    def feasible(self) -> list[dict]:
        return [r for r in self.rows if r["meets"]]


def search(
    fixed: Fixed,
    space: SearchSpace,
    slos: list[Slo],
    prices: dict,
    backend: Backend,
    results: Path,
    budget: float | None,
    capacity_top: int,
    max_rate: float,
    capacity_steps: int,
    progress=None,
) -> Searched:
    """Every replica chain of the grid, then the capacity of the `capacity_top` cheapest that
    meet the SLOs, both on `backend`; results stream into (and are taken from) `results`."""
    ok = lambda result: meets(result, slos)  # noqa: E731
    cost = lambda point: cost_per_hour(point, prices)  # noqa: E731
    chains = space.chains()
    too_big = space.grid_size - sum(len(c) for c in chains)
    logs = [ChainLog([]) for _ in chains]
    runner = Runner(fixed, backend, results, progress)
    runner.run([replicas_chain(c, ok, budget, cost, log) for c, log in zip(chains, logs)])
    evaluated = [pr for log in logs for pr in log.simulated]
    unique = {point_key(p): (p, r) for p, r in reversed(evaluated)}  # the first of each
    rows = report.rows(list(unique.values()), slos, prices)
    feasible = [r for r in rows if r["meets"]]
    # capacity of the cheapest few that meet the SLOs, in parallel
    cap_logs = {r["label"]: ChainLog([]) for r in feasible[:capacity_top]}
    runner.run(
        [
            capacity_chain(r["point"], ok, cap_logs[r["label"]], max_rate, capacity_steps)
            for r in feasible[:capacity_top]
        ]
    )
    fronts = {s.name: report.pareto(rows, s) for s in slos}
    return Searched(
        logs, cap_logs, evaluated, unique, rows, fronts, too_big, runner.simulated, runner.reused
    )


def _capacity_text(searched: Searched) -> dict[str, str]:
    """What the table and the summary print of each capacity searched."""
    return {
        name: ("at least " if log.capacity_capped else "") + f"{log.capacity:.3g}x"
        for name, log in searched.cap_logs.items()
    }


def build(
    searched: Searched, fixed: Fixed, space: SearchSpace, slos: list[Slo], prices: dict
) -> dict:
    """plan.json's content: the inputs, what was simulated and pruned, the answer (or how far
    from one), the Pareto fronts, the capacity curves and every deployment's row."""
    s, rows = searched, searched.rows
    capacity = {name: log.capacity for name, log in s.cap_logs.items()}
    counts = {
        "grid": space.grid_size,
        "simulated_grid_points": len(rows),
        "same_as_another_point": len(s.evaluated) - len(rows),
        "pruned_more_replicas_than_needed": sum(log.pruned_dominated for log in s.logs),
        "pruned_over_budget": sum(log.pruned_budget for log in s.logs),
        "pruned_cannot_run": sum(log.pruned_invalid for log in s.logs),
        "pruned_over_max_devices": s.too_big,
        "capacity_simulations": sum(len(log.simulated) for log in s.cap_logs.values()),
        "simulations_run": s.simulated,
        "simulations_reused": s.reused,
    }
    feasible = s.feasible
    best = feasible[0] if feasible else None
    return {
        "fixed": fixed.__dict__,
        "slos": {slo.name: slo.target_s for slo in slos},
        "prices": prices,
        "space": {**space.axes, "max_devices": space.max_devices},
        "counts": counts,
        "best": None if best is None else {**best, "capacity": capacity.get(best["label"])},
        "infeasible": None if best else report.infeasible(rows, slos),
        "pareto": {name: [r["label"] for r in front] for name, front in s.fronts.items()},
        "capacity": {
            name: {
                "capacity": log.capacity,
                "at_least": log.capacity_capped,
                "curve": [
                    {"rate": p["rate"], "meets": meets(res, slos), **_curve_point(res, slos)}
                    for p, res in log.simulated
                ],
            }
            for name, log in s.cap_logs.items()
        },
        "deployments": rows,
    }


def write(out: Path, plan: dict, searched: Searched, slos: list[Slo], plots: bool) -> str:
    """plan.json, plan.md and (with `plots`) pareto.png and capacity.png in `out`; returns
    plan.md's text, the answer `medha plan` prints."""
    s, rows = searched, searched.rows
    (out / "plan.json").write_text(json.dumps(_finite(plan), indent=1, allow_nan=False))
    capacity = _capacity_text(s)
    table = report.markdown(rows, slos, capacity)
    feasible = s.feasible
    best = feasible[0] if feasible else None
    text = report.summary(plan, slos, plan["counts"], best, capacity) + "\n" + table
    (out / "plan.md").write_text(text)
    if plots:
        at_1x = {report.label(p): ({**p, "rate": 1.0}, r) for p, r in s.unique.values()}
        curves = {
            name: _capacity_curve([at_1x[name], *log.simulated], slos)
            for name, log in s.cap_logs.items()
        }
        report.plot(out, rows, slos, s.fronts, curves)
    return text


def _curve_point(result: dict, slos) -> dict:
    if "error" in result:
        return {"error": result["error"]}
    return {s.name: s.value(result) for s in slos} | {
        "slo_attainment": result.get("slo_attainment")
    }


def _capacity_curve(points: list[tuple[dict, dict]], slos) -> list[tuple[float, float, float]]:
    """(rate, worst SLO metric / target, SLO attainment) of each simulation that ran."""
    return [
        (p["rate"], report.worst_over_target(_curve_point(r, slos), slos), r.get("slo_attainment"))
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
