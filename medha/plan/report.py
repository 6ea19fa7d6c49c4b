"""From the plan's results to its answer: which points meet the SLOs, the Pareto front of cost
against each SLO metric, the cheapest deployment, what to say when nothing meets them, and
plan.md's table and summary."""

from __future__ import annotations

import math

from medha.plan.cost import cost_per_hour, devices
from medha.plan.search import Result, meets
from medha.plan.slo import Slo


def label(point: dict) -> str:
    parts = [
        f"{point['replicas']}x {point['hardware']}",
        f"tp{point['tp']}"
        + (f" spp{point['spp']}" if point["spp"] > 1 else "")
        + (f" kvp{point['kvp']}" if point["kvp"] > 1 else ""),
        point["scheduler"],
    ]
    if point["iteration_budget_s"] is not None:
        parts.append(f"budget {point['iteration_budget_s']:g}s")
    if point["replicas"] > 1:
        parts.append(point["dispatcher"])
    if point["kv_memory_gb"] is not None:
        parts.append(f"kv {point['kv_memory_gb']:g}GiB")
    return ", ".join(parts)


def rows(evaluated: list[tuple[dict, Result]], slos: list[Slo], prices: dict) -> list[dict]:
    """One row per simulated deployment at the trace's own rate, cheapest first."""
    out = []
    for point, result in evaluated:
        row = {
            "point": point,
            "label": label(point),
            "devices": devices(point),
            "cost_per_hour": cost_per_hour(point, prices),
            "meets": meets(result, slos),
        }
        if "error" in result:
            row["error"] = result["error"]
        else:
            row["metrics"] = {s.name: s.value(result) for s in slos}
            row["completed"] = result["requests"]["completed"]
            row["requests"] = result["requests"]["total"]
            row["slo_attainment"] = result.get("slo_attainment")
        out.append(row)
    out.sort(key=lambda r: (r["cost_per_hour"], _badness(r, slos), r["label"]))
    return out


def worst_over_target(metrics: dict[str, float], slos: list[Slo]) -> float:
    """How far from meeting every SLO: the worst metric / its target (<= 1 meets them all)."""
    return max(metrics[s.name] / s.target_s for s in slos)


def _finished(row: dict) -> bool:
    """The simulation ran and every request finished: its metrics stand for the deployment."""
    return "metrics" in row and row["completed"] == row["requests"]


def _badness(row: dict, slos: list[Slo]) -> float:
    if not _finished(row):
        return math.inf
    return worst_over_target(row["metrics"], slos)


def pareto(rows_: list[dict], slo: Slo) -> list[dict]:
    """The rows no other row beats on both cost and this SLO's metric (cheapest first)."""
    ran = [r for r in rows_ if _finished(r)]
    ran.sort(key=lambda r: (r["cost_per_hour"], r["metrics"][slo.name], r["label"]))
    front, best = [], math.inf
    for r in ran:  # at one cost, only the best can be on the front
        if r["metrics"][slo.name] < best and (
            not front or r["cost_per_hour"] > front[-1]["cost_per_hour"]
        ):
            front.append(r)
            best = r["metrics"][slo.name]
    return front


def infeasible(rows_: list[dict], slos: list[Slo]) -> dict:
    """Nothing meets every SLO: for each, the closest any deployment came, and the deployment
    closest to meeting them all."""
    ran = [r for r in rows_ if _finished(r)]
    per_slo = {}
    for s in slos:
        if not ran:
            break
        r = min(ran, key=lambda r: (r["metrics"][s.name], r["cost_per_hour"]))
        v = r["metrics"][s.name]
        per_slo[s.name] = {
            "target_s": s.target_s,
            "best_s": v,
            "miss_factor": v / s.target_s,
            "met_by_some": v <= s.target_s,
            "closest": r["label"],
        }
    closest = min(ran, key=lambda r: (_badness(r, slos), r["cost_per_hour"])) if ran else None
    return {
        "per_slo": per_slo,
        "closest": None
        if closest is None
        else {"label": closest["label"], "worst_value_over_target": _badness(closest, slos)},
        "unfinished": len(rows_) - len(ran),
    }


def markdown(rows_: list[dict], slos: list[Slo], capacity: dict[str, str]) -> str:
    head = "| deployment | devices | $/h | " + " | ".join(s.name for s in slos)
    head += " | meets | capacity |\n|---|---|---|" + "---|" * len(slos) + "---|---|\n"
    lines = []
    for r in rows_:
        if "metrics" in r:
            vals = " | ".join(f"{r['metrics'][s.name]:.3g} s" for s in slos)
            if r["completed"] < r["requests"]:
                vals += f" ({r['requests'] - r['completed']} unfinished)"
        else:
            vals = " | ".join(["-"] * len(slos))
        cap = capacity.get(r["label"])
        lines.append(
            f"| {r['label']} | {r['devices']} | {r['cost_per_hour']:.2f} | {vals} | "
            f"{'yes' if r['meets'] else 'no'} | {cap or ''} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(out_dir, rows_: list[dict], slos: list[Slo], fronts: dict, curves: dict) -> list[str]:
    """pareto.png (cost against each SLO metric) and capacity.png (each SLO metric over its
    target, and SLO attainment, against the rate, for the deployments searched for capacity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, len(slos), figsize=(5 * len(slos), 4), squeeze=False)
    for ax, s in zip(axes[0], slos):
        pts = [(r["cost_per_hour"], r["metrics"][s.name]) for r in rows_ if "metrics" in r]
        pts = [(c, v) for c, v in pts if math.isfinite(v)]
        if pts:
            ax.scatter(*zip(*pts), s=12, c="0.7", label="simulated")
        front = [(r["cost_per_hour"], r["metrics"][s.name]) for r in fronts[s.name]]
        if front:
            ax.step(*zip(*front), where="post", c="C0", marker="o", label="Pareto front")
        ax.axhline(s.target_s, c="C3", ls="--", label="SLO")
        ax.set_xlabel("US$ per hour")
        ax.set_ylabel(f"{s.name} (s)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "pareto.png", dpi=110)
    plt.close(fig)
    written.append("pareto.png")
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for i, (name, pts) in enumerate(curves.items()):
            pts = sorted(pts)
            rates = [p[0] for p in pts]
            worst = [p[1] for p in pts]
            att = [p[2] for p in pts]
            axes[0].plot(rates, worst, marker="o", c=f"C{i}", label=name)
            axes[1].plot(rates, att, marker="o", c=f"C{i}", label=name)
        axes[0].axhline(1.0, c="C3", ls="--")
        axes[0].set_ylabel("worst SLO metric / target")
        axes[0].set_yscale("log")
        axes[1].set_ylabel("SLO attainment (requests meeting TTFT and TPOT)")
        for ax in axes:
            ax.set_xlabel("request rate (x the trace's)")
            ax.set_xscale("log", base=2)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "capacity.png", dpi=110)
        plt.close(fig)
        written.append("capacity.png")
    return written


def summary(plan: dict, slos, counts: dict, best, capacity: dict) -> str:
    """plan.md's head: the grid and what was saved, then the cheapest deployment that meets
    every SLO (and how to route it), or how close any came."""
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


def _devices(n: int) -> str:
    return f"{n} device" + ("s" if n != 1 else "")
