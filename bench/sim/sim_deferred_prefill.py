"""Deferred prefill (Mohanty et al., EuroMLSys 2025): throughput over the departure threshold K.

    python bench/sim/sim_deferred_prefill.py [--num-requests 20000] [--seeds 0 1] [--mixed]

C = 410, prompts of 285 tokens, geometric outputs with mean 201; Llama-3-8B on one H100
(roofline predictor). The deferred policy with whole prefills, each in an iteration of its own
(vLLM without chunked prefill, the system the paper measured), every request queued at t=0;
throughput is measured while the backlog lasts, averaged over --seeds. --mixed adds the same
curve with prefills riding along in decode iterations (medha's default batching).
"""

from __future__ import annotations

import argparse
import dataclasses

from medha.analysis.deferred_prefill_curve import Curve, DeferredPrefillArgs, compute, distance
from medha.benchmark.harness import add_common_args
from medha.perf import ParallelConfig, make_predictor
from medha.sim.simulator import ClusterConfig

K_VALUES = "1,2,4,8,12,16,20,24,28,32,36,40,44,48,56,64,80,96,128,192"
CLUSTER = ClusterConfig(model="llama-3-8b", hardware="h100")


def averaged(args: DeferredPrefillArgs, seeds: list[int], predictor) -> Curve:
    """The curve with simulated requests/s averaged over seeds (the same K grid each time)."""
    curves = [
        compute(dataclasses.replace(args, seed=s), predictor, CLUSTER, ParallelConfig())
        for s in seeds
    ]
    first = curves[0]
    for k, point in first.sim.items():
        points = [c.sim[k] for c in curves]
        first.sim[k] = dataclasses.replace(
            point,
            **{
                name: sum(getattr(p, name) for p in points) / len(points)
                for name in ("requests_per_s", "departures_per_s", "mean_group")
            },
        )
    return first


def markdown(curve: Curve) -> str:
    rows = [
        "| K | Prop. 1 req/s | renewal req/s | simulated req/s | prompts per prefill |",
        "|---|---|---|---|---|",
    ]
    for k in curve.approx:
        p = curve.sim[k]
        rows.append(
            f"| {k} | {curve.approx[k]:.2f} | {curve.renewal[k]:.2f} | "
            f"{p.requests_per_s:.2f} | {p.mean_group:.2f} |"
        )
    return "\n".join(rows)


def acceptance(curve: Curve) -> str:
    sim, k_sim = curve.simulated, curve.k_sim
    interior = k_sim not in (min(sim), max(sim))
    rows = [
        "| | paper | ours |",
        "|---|---|---|",
        f"| simulated curve has an interior maximum | yes | "
        f"{'yes' if interior else 'no'}: best K = {k_sim} |",
        # the paper's K gaps (Table 1: K_num 26 vs K_exp 32, 58 vs 75); its 1.3% and 18% are
        # gaps between throughputs, not between K
        f"| analytic K* vs simulated best | 18.75%, 22.67% | Prop. 1 K* = "
        f"{curve.k_approx} ({distance(curve.k_approx, k_sim):.1f}%), renewal K* = "
        f"{curve.k_renewal} ({distance(curve.k_renewal, k_sim):.1f}%) |",
        f"| best K over K = 1 | about +13.5% | {sim[k_sim]:.2f} vs {sim[1]:.2f} req/s, "
        f"{100 * (sim[k_sim] / sim[1] - 1):+.1f}% (Prop. 1 predicts "
        f"{100 * (curve.approx[curve.k_approx] / curve.approx[1] - 1):+.1f}%, renewal "
        f"{100 * (curve.renewal[curve.k_renewal] / curve.renewal[1] - 1):+.1f}%) |",
    ]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap, num_requests=20000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--k-values", default=K_VALUES)
    ap.add_argument(
        "--mixed", action="store_true", help="also the curve with prefills inside decode iterations"
    )
    args = ap.parse_args()
    predictor = make_predictor(CLUSTER.predictor, CLUSTER.model, CLUSTER.hardware, ParallelConfig())
    modes = [True, False] if args.mixed else [True]
    for prefill_only in modes:
        options = DeferredPrefillArgs(
            prefill_only_iterations=prefill_only,
            simulate=True,
            k_values=args.k_values,
            num_requests=args.num_requests,
        )
        curve = averaged(options, args.seeds, predictor)
        title = (
            "prefills in iterations of their own"
            if prefill_only
            else "prefills inside decode iterations"
        )
        print(
            f"\n### {title}: C = 410, d_0 = 285, mean output 201, {predictor.describe()}, "
            f"{args.num_requests} requests, seeds {args.seeds}\n"
        )
        c = curve.costs
        print(
            f"Prop. 1 costs: c_p = {c.c_p * 1e3:.3f} ms, t_p = {c.t_p * 1e6:.3f} us/token, "
            f"c_d = {c.c_d * 1e3:.3f} ms, t_d = {c.t_d * 1e6:.2f} us/request\n"
        )
        print(markdown(curve))
        print()
        print(acceptance(curve))


if __name__ == "__main__":
    main()
