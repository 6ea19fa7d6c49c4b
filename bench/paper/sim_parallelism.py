"""Stream-pipeline and KV-cache parallelism (Medha Fig. 5b, 17 and 7a), simulated.

    python bench/paper/sim_parallelism.py [--hardware h100]

SPP: TTFT of one 1M-token Llama-3-8B prefill at SPP 1, 2, 4, 8 (TP8 per stage, 50 ms batch
budget); scaling efficiency = T(1) / (p x T(p)).
KVP: decode TPOT of one request at 1M to 10M tokens of context with KVP 1, 2, 4 (TP8 x SPP4 per
group, so that 10M tokens of KV fit; groups of context / kvp tokens each, joining as the KV grows:
the paper's Fig. 6 layout, where the block manager's placement and the predictor's timing agree).
bench/paper/sim_parallel_figures.py has the paper's whole set (Fig. 3b, 15-20, up to SPP16 and 70B).
"""

from __future__ import annotations

import argparse

from medha.core.request import Request
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.simulator import ClusterConfig, Simulator


def ttft_1m(hardware: str, spp: int) -> float:
    sim = Simulator(
        ClusterConfig(hardware=hardware),
        ParallelConfig(tp=8, spp=spp),
        SchedulerConfig(iteration_budget_s=0.05),
    )
    r = Request("long", 0.0, 1_000_000, 1)
    sim.run([r])
    return r.ttft_s


def tpot(hardware: str, context: int, kvp: int) -> float:
    sim = Simulator(
        ClusterConfig(hardware=hardware),
        ParallelConfig(tp=8, spp=4, kvp=kvp, max_tokens_per_kvp_group=-(-context // kvp)),
        SchedulerConfig(max_model_len=context + 64, iteration_budget_s=0.2),
    )
    r = Request("long", 0.0, context, 17)
    sim.run([r])
    t = r.token_times_s
    return (t[-1] - t[0]) / (len(t) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hardware", default="h100")
    args = ap.parse_args()

    print(f"SPP: one 1M-token prefill, Llama-3-8B, TP8 per stage, {args.hardware}\n")
    print("| SPP | GPUs | TTFT | speed-up | scaling efficiency |")
    print("|---|---|---|---|---|")
    base = None
    for spp in (1, 2, 4, 8):
        t = ttft_1m(args.hardware, spp)
        base = base or t
        print(f"| {spp} | {8 * spp} | {t:.1f} s | {base / t:.2f}x | {base / (spp * t):.0%} |")

    print(f"\nKVP: decode TPOT of one request, Llama-3-8B, TP8 x SPP4 per group, {args.hardware}\n")
    print("| context | KVP 1 | KVP 2 | KVP 4 | KVP 2 vs 1 | KVP 4 vs 1 |")
    print("|---|---|---|---|---|---|")
    for millions in (1, 2, 4, 10):
        ctx = millions * 1_000_000
        t1, t2, t4 = (tpot(args.hardware, ctx, k) for k in (1, 2, 4))
        print(
            f"| {millions}M | {t1 * 1e3:.1f} ms | {t2 * 1e3:.1f} ms | {t4 * 1e3:.1f} ms | "
            f"{t2 / t1 - 1:+.0%} | {t4 / t1 - 1:+.0%} |"
        )


if __name__ == "__main__":
    main()
