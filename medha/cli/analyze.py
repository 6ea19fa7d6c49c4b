"""`medha analyze`: analytic models of scheduling policies."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from medha.analysis.deferred_prefill_curve import Curve, DeferredPrefillArgs, distance
from medha.cli.common import CliError, add_platform_args, predictor_from_args
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args

if TYPE_CHECKING:
    from medha.analysis.deferred_prefill import Costs
    from medha.perf import ParallelConfig, Predictor

DESCRIPTION = """\
Throughput of the deferred-prefill policy (Mohanty et al., EuroMLSys 2025) over the departure
threshold K: new prompts are admitted only after K requests have left a batch of at most C.
Prints, for each K, the requests per second of Proposition 1's closed form (costs c_p, t_p, c_d,
t_d fitted to the predictor), of the exact renewal model (the predictor's own step times), and
with --simulate of the real scheduler in the simulator; then K* = argmax of each.
The model and its derivation: medha/analysis/deferred_prefill.py and docs/reproductions.md.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="analytic models of scheduling policies",
        description="Analytic models of scheduling policies, beside the simulator's numbers.",
    )
    models = p.add_subparsers(dest="model_name", metavar="MODEL", required=True)
    q = models.add_parser(
        "deferred-prefill",
        help="throughput over the departure threshold K",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_platform_args(q, "llama-3-8b", "h100")
    add_dataclass_args(q, DeferredPrefillArgs, title="system and curve")
    q.set_defaults(func=run_deferred_prefill)


def run_deferred_prefill(args: argparse.Namespace) -> None:
    from medha.sim.config import ClusterConfig

    predictor = predictor_from_args(args)
    try:
        options = dataclass_from_args(DeferredPrefillArgs, args)
        cluster = ClusterConfig(model=args.model, hardware=args.hardware, predictor=args.predictor)
        print(analyze(options, predictor, cluster, predictor.parallel))
    except ValueError as e:
        raise CliError(str(e)) from None


def analyze(
    args: DeferredPrefillArgs,
    predictor: Predictor,
    cluster=None,
    parallel: ParallelConfig | None = None,
) -> str:
    """The report of `medha analyze deferred-prefill` as text."""
    from medha.analysis.deferred_prefill_curve import compute, cost_model

    predictor = cost_model(args, predictor)
    curve = compute(args, predictor, cluster, parallel)
    return "\n".join(header(args, predictor, curve.costs) + table(curve) + summary(curve))


def header(args: DeferredPrefillArgs, predictor: Predictor, costs: Costs) -> list[str]:
    mode = (
        "prefills in iterations of their own"
        if args.prefill_only_iterations
        else "prefills inside decode iterations"
    )
    return [
        f"deferred prefill: C={args.batch_cap}, d_0={args.prompt_tokens} tokens, geometric "
        f"outputs with mean {args.mean_output} (alpha={1 / args.mean_output:.5f}); {mode}",
        predictor.describe(),
        f"Prop. 1 costs (fitted around K*): {describe_costs(costs)}",
        "",
    ]


def table(c: Curve) -> list[str]:
    head = f"{'K':>5s} {'Prop. 1 req/s':>14s} {'renewal req/s':>14s}"
    if c.sim:
        head += f" {'simulated req/s':>16s} {'prompts/prefill':>16s}"
    rows = [head]
    for k in c.approx:
        row = f"{k:5d} {c.approx[k]:14.2f} {c.renewal[k]:14.2f}"
        if c.sim:
            row += f" {c.sim[k].requests_per_s:16.2f} {c.sim[k].mean_group:16.2f}"
        rows.append(row)
    return rows + [""]


def summary(c: Curve) -> list[str]:
    out = [
        f"K* (Prop. 1) = {c.k_approx}: {gain(c.approx, c.k_approx)}",
        f"K* (renewal) = {c.k_renewal}: {gain(c.renewal, c.k_renewal)}",
    ]
    if c.sim:
        out.append(f"simulated best K = {c.k_sim}: {gain(c.simulated, c.k_sim)}")
        for name, k in (("Prop. 1", c.k_approx), ("renewal", c.k_renewal)):
            out.append(f"K* ({name}) lies {distance(k, c.k_sim):.0f}% from the simulated best K")
    return out


def describe_costs(c: Costs) -> str:
    return (
        f"c_p = {c.c_p * 1e3:.3f} ms, t_p = {c.t_p * 1e6:.3f} us/token, "
        f"c_d = {c.c_d * 1e3:.3f} ms, t_d = {c.t_d * 1e6:.2f} us/request"
    )


def gain(curve: dict[int, float], k: int) -> str:
    return f"{curve[k]:.2f} req/s, {100 * (curve[k] / curve[1] - 1):+.1f}% over K=1"
