"""Per-iteration scheduling cost with a deep queue: 1,000 waiting and 256 decoding requests.

    python bench/sim/scheduler_overhead.py [--policy lars] [--chunking adaptive] [--iterations 2000]

The population is held steady: the 256 decodes never finish, and every request that completes
its prefill is swapped for a fresh waiting one (outside the timed region). Only `schedule()`
is timed; `update()` is timed apart. Llama-3-8B on 8 x H100 (TP8), 50 ms budget.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import numpy as np

from medha.benchmark.harness import add_common_args, percentile
from medha.core.batch import BatchResult
from medha.core.request import Request
from medha.perf import ParallelConfig, make_predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import ReplicaScheduler


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", default="lars")
    ap.add_argument("--chunking", default="adaptive")
    ap.add_argument("--waiting", type=int, default=1000)
    ap.add_argument("--decoding", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=2000)
    add_common_args(ap, seed=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    pred = make_predictor("roofline", "llama-3-8b", "h100", ParallelConfig(tp=8))
    cfg = SchedulerConfig(
        policy=args.policy,
        chunking=args.chunking,
        iteration_budget_s=0.05,
        max_num_seqs=args.decoding + 64,
    )
    sched = ReplicaScheduler(cfg, pred, BlockManager(1 << 20))
    now, counter = 0.0, 0

    def fresh(prompt_max: int = 32_000, out: int = 256) -> Request:
        nonlocal counter
        counter += 1
        return Request(f"r{counter}", now, rng.randint(16, prompt_max), out)

    # Build the decoding set: prompts prefilled, max_tokens large enough to outlast the run.
    decoders = [fresh(2000, out=args.iterations + 100) for _ in range(args.decoding)]
    for r in decoders:
        sched.add_request(r, now)
    while sched.num_decoding < args.decoding:
        batch = sched.schedule(now)
        now += batch.predicted_time_s
        sched.update(batch, BatchResult(batch.predicted_time_s), now)
    for _ in range(args.waiting):
        sched.add_request(fresh(), now)

    sched_ns, update_ns, sizes = [], [], []
    gc.collect()
    for _ in range(args.iterations):
        t0 = time.perf_counter_ns()
        batch = sched.schedule(now)
        t1 = time.perf_counter_ns()
        now += batch.predicted_time_s
        sched.update(batch, BatchResult(batch.predicted_time_s), now)
        t2 = time.perf_counter_ns()
        sched_ns.append(t1 - t0)
        update_ns.append(t2 - t1)
        sizes.append((len(batch.decodes), len(batch.prefills)))
        # keep the population steady
        for chunk in batch.prefills:
            r = chunk.request
            if r.state.name == "DECODING":
                sched.abort(r.request_id, now)
                sched.add_request(fresh(), now)
    # --waiting counts the whole prefill-phase queue: not started and started alike
    assert sum(sched.prefill_counts()) == args.waiting and sched.num_decoding == args.decoding

    ms = np.array(sched_ns) / 1e6
    print(
        f"schedule() with {args.waiting} waiting + {args.decoding} decoding, "
        f"{args.policy} + {args.chunking}, {args.iterations} iterations"
    )
    print(
        f"  p50 {percentile(ms, 50):.3f} ms   p99 {percentile(ms, 99):.3f} ms   "
        f"max {ms.max():.3f} ms"
    )
    up = np.array(update_ns) / 1e6
    print(f"update(): p50 {percentile(up, 50):.3f} ms   p99 {percentile(up, 99):.3f} ms")
    d, p = np.mean(sizes, axis=0)
    print(f"mean batch: {d:.0f} decodes + {p:.1f} prefill chunks")


if __name__ == "__main__":
    main()
