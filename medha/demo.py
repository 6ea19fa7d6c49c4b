"""The workload and the comparison table of `medha demo` (medha/cli/demo.py says what it
shows)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from medha.core.request import Request
from medha.perf import Predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.sim.replay import replay

CONFIGS = [
    ("orca / vLLM (no chunking)", "fcfs", "none"),
    ("sarathi (static:512)", "fcfs", "static:512"),
    ("edf + adaptive", "edf", "adaptive"),
    ("medha: lars + adaptive", "lars", "adaptive"),
]


@dataclass
class DemoWorkload:
    num_short: int = 40
    short_qps: float = 1.0
    long_prompt: int = 6000
    long_at_s: float = 2.0
    seed: int = 0

    def requests(self, max_context: int) -> list[Request]:
        rng = random.Random(self.seed)
        long_prompt = min(self.long_prompt, max_context - 64)
        reqs = [Request("long-0", self.long_at_s, long_prompt, 32)]
        t = 0.0
        for i in range(self.num_short):
            t += rng.expovariate(self.short_qps)
            reqs.append(Request(f"short-{i}", t, rng.randint(32, 256), rng.randint(16, 64)))
        return reqs


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_config(
    predictor: Predictor,
    policy: str,
    chunking: str,
    workload: DemoWorkload,
    base: SchedulerConfig,
    kv_blocks: int,
) -> dict:
    config = SchedulerConfig(**{**base.__dict__, "policy": policy, "chunking": chunking})
    sched = ReplicaScheduler(config, predictor, BlockManager(kv_blocks))
    reqs = workload.requests(sched.max_model_len)
    end = replay(sched, reqs)
    short = [r for r in reqs if r.request_id.startswith("short")]
    long_ = [r for r in reqs if r.request_id.startswith("long")]
    tbt = [b - a for r in short for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    return {
        "short_ttft_p50": _pct([r.ttft_s for r in short], 50),
        "short_ttft_p99": _pct([r.ttft_s for r in short], 99),
        "long_ttft": long_[0].ttft_s,
        "short_tbt_p99": _pct(tbt, 99),
        "short_met": sum(r.ttft_s <= r.deadline_s - r.arrival_s for r in short) / len(short),
        "long_deadline": long_[0].deadline_s - long_[0].arrival_s,
        "makespan": end,
        "batches": sched.stats.batches,
    }


def demo_table(
    predictor: Predictor, workload: DemoWorkload, base: SchedulerConfig, kv_blocks: int
) -> str:
    header = (
        f"{'configuration':28s} {'short TTFT p50':>15s} {'p99':>7s} {'met':>5s} "
        f"{'short TBT p99':>14s} {'long TTFT / deadline':>21s}"
    )
    lines = [header, "-" * len(header)]
    for label, policy, chunking in CONFIGS:
        m = run_config(predictor, policy, chunking, workload, base, kv_blocks)
        lines.append(
            f"{label:28s} {m['short_ttft_p50']:14.2f}s {m['short_ttft_p99']:6.2f}s "
            f"{m['short_met']:5.0%} {m['short_tbt_p99']:13.3f}s "
            f"{m['long_ttft']:11.1f}s / {m['long_deadline']:.1f}s"
        )
    return "\n".join(lines)
