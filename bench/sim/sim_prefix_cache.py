"""The prefix cache in the simulator, on Mooncake's conversation trace (bundled: mooncake_conv).

    python bench/sim/sim_prefix_cache.py [--num-requests 3000] [--repeats 3]

Llama-3-8B on one replica of 8 A100s (tp 8), lars + adaptive, the trace's first
--num-requests requests at half their rate (--time-scale 2: one replica at the full rate is
overloaded with or without a cache). Prints:

1. speed: requests per wall second with the cache off, on the device, and with a host tier,
   alternated --repeats times, and the ratios to off;
2. bounded tiers: hit rate (of all prompt tokens, and per class), prefill FLOPs saved, TTFT
   p50/p99 per configuration, and what the host tier adds over the device alone;
3. an unbounded cache (a host tier that never fills): the hit tokens against the direct count
   over the trace (`medha trace reuse`'s unbounded number, less the partial last page a hit
   never covers), at the trace's timing and with the requests one at a time (--spread-gap-s
   apart), so that every earlier prompt is computed before a request starts: there the two
   are equal, request by request.
"""

from __future__ import annotations

import argparse
import statistics

from medha.benchmark.harness import add_common_args
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.prefix_cache import reusable_prefix_tokens
from medha.sim.runner import RunSpec, simulate
from medha.sim.simulator import KV_BLOCK_SIZE, ClusterConfig, Simulator
from medha.sim.workload.generator import WorkloadConfig, build_requests

MODES = {
    "off": dict(prefix_cache="off"),
    "device": dict(prefix_cache="device"),
    "device+host": dict(prefix_cache="device+host"),
}


def run(mode: dict, n: int, time_scale: float):
    spec = RunSpec(
        name=mode["prefix_cache"],
        cluster=ClusterConfig(),
        parallel=ParallelConfig(tp=8),
        scheduler=SchedulerConfig(**mode),
    )
    return simulate(
        spec, WorkloadConfig(trace="mooncake_conv", num_requests=n, time_scale=time_scale)
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap, num_requests=3000)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-cache-gb", type=float, default=64.0, help="host tier per device")
    ap.add_argument("--exact-requests", type=int, default=1000)
    ap.add_argument(
        "--spread-gap-s", type=float, default=600.0, help="arrival gap when one at a time"
    )
    args = ap.parse_args()
    MODES["device+host"]["host_cache_gb"] = args.host_cache_gb

    walls: dict[str, list[float]] = {m: [] for m in MODES}
    outcomes = {}
    for _ in range(args.repeats):
        for name, mode in MODES.items():
            outcome = run(mode, args.num_requests, args.time_scale)
            walls[name].append(outcome.summary["sim"]["wall_s"])
            outcomes[name] = outcome
    print(
        f"mooncake_conv, first {args.num_requests} requests at 1/{args.time_scale:g} of their "
        f"rate, llama-3-8b on 8 A100s (tp 8), lars + adaptive; host tier "
        f"{args.host_cache_gb:g} GiB per device\n"
    )
    print("1. speed (simulation wall time, median of the runs; requests per wall second)")
    base = statistics.median(walls["off"])
    for name, w in walls.items():
        med = statistics.median(w)
        print(
            f"   {name:12s} {med:6.2f} s  {args.num_requests / med:7.0f} req/s  "
            f"{med / base:.2f}x the time of off  (runs: {', '.join(f'{x:.2f}' for x in w)})"
        )

    print("\n2. bounded tiers")
    print(
        "   | cache | hit rate (all / short / long) | host hits | prefill FLOPs saved | "
        "TTFT p50 | TTFT p99 | short TTFT p99 |"
    )
    print("   |---|---|---|---|---|---|---|")
    for name, o in outcomes.items():
        s = o.summary
        pc = s.get("prefix_cache")
        rates = (
            " / ".join(f"{pc[c]['hit_rate']:.1%}" for c in ("all", "short", "long")) if pc else "-"
        )
        host = f"{pc['all']['host_hit_tokens'] / pc['all']['prompt_tokens']:.1%}" if pc else "-"
        flops = f"{pc['all']['prefill_flops_saved_fraction']:.1%}" if pc else "-"
        print(
            f"   | {name} | {rates} | {host} | {flops} | {s['ttft_s']['p50']:.2f} s | "
            f"{s['ttft_s']['p99']:.2f} s | {s['by_class']['short']['ttft_s']['p99']:.2f} s |"
        )
    pc = outcomes["device+host"].summary["prefix_cache"]["all"]
    dev = outcomes["device"].summary["prefix_cache"]["all"]
    print(
        f"   reusable by the direct count: {pc['reusable_fraction']:.1%} of prompt tokens; "
        f"the host tier adds {pc['hit_rate'] - dev['hit_rate']:.1%} of them "
        f"({dev['hit_rate']:.1%} -> {pc['hit_rate']:.1%}); "
        f"{pc['host_hit_tokens'] / pc['prompt_tokens']:.1%} of prompt tokens were copied back "
        "from it for the request that hit them"
    )

    print("\n3. an unbounded cache against the direct count over the trace")
    unbounded = SchedulerConfig(prefix_cache="device+host", host_cache_blocks=1 << 40)
    for label, gap in (("trace timing", None), ("one at a time", args.spread_gap_s)):
        sim = Simulator(ClusterConfig(), ParallelConfig(tp=8), unbounded)
        work = WorkloadConfig(trace="mooncake_conv", num_requests=args.exact_requests)
        reqs = build_requests(work, sim.max_model_len)
        for i, r in enumerate(reqs):
            r.arrival_s = r.arrival_s * args.time_scale if gap is None else i * gap
        result = sim.run(reqs)
        direct = reusable_prefix_tokens(reqs, KV_BLOCK_SIZE)
        hits = sum(r.num_cached_tokens for r in reqs)
        prompt = sum(r.prompt_len for r in reqs)
        exact = sum(r.num_cached_tokens == direct[r.request_id] for r in reqs)
        preempted = sum(s.preemptions for s in result.scheduler_stats)
        print(
            f"   {label}: direct count {sum(direct.values())} tokens "
            f"({sum(direct.values()) / prompt:.2%} of {prompt}), "
            f"hits {hits} ({hits / prompt:.2%}); "
            f"requests whose hit equals their count: {exact}/{len(reqs)}; preemptions {preempted}"
        )


if __name__ == "__main__":
    main()
