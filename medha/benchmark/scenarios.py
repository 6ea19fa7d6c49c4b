"""The paper's scheduling scenarios, run through the real scheduler by the simulator's replay:
tests/test_scenarios.py checks their outcomes, bench/sim/scheduling_scenarios.py tabulates them for
every policy. The toy scheduler they run on is also the one of the tests (tests/conftest.py).
"""

from __future__ import annotations

from medha.core.request import Request
from medha.perf import ParallelConfig, make_predictor
from medha.perf.toy_predictor import FixedCostPredictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.sim.replay import replay

TOKEN_S = 1 / 1024  # exact in binary, so toy timelines carry no rounding drift
# 1024 tokens per second and 128-token iterations: every time below is an exact binary
# fraction, so iteration boundaries land exactly on t = 5 s and deadlines compare exactly.
BUDGET = 1 / 8


def toy_scheduler(
    policy="lars",
    chunking="adaptive",
    num_blocks=1 << 16,
    token_s=TOKEN_S,
    iteration_s=0.0,
    blocks: BlockManager | None = None,
    **config,
) -> ReplicaScheduler:
    """`blocks` replaces the plain BlockManager of `num_blocks` blocks."""
    config.setdefault("iteration_budget_s", 1 / 16)
    cfg = SchedulerConfig.from_flat(policy=policy, chunking=chunking, **config)
    return ReplicaScheduler(
        cfg, FixedCostPredictor(token_s, iteration_s), blocks or BlockManager(num_blocks)
    )


def illustrative(policy, chunking, **config):
    """The TTFT of each request of the paper's illustrative example: r_L (10 s of work, deadline
    16 s) at t=0, r_S1 and r_S2 (0.5 s each, deadline 1 s) at t=5."""
    # r_L counts as long (space sharing, one per batch); the short requests do not
    sched = toy_scheduler(
        policy, chunking, iteration_budget_s=BUDGET, long_prefill_threshold=4096, **config
    )
    reqs = [
        Request("r_L", 0.0, 10 * 1024, 1, ttft_deadline_s=16.0),  # 10 s of work
        Request("r_S1", 5.0, 512, 1, ttft_deadline_s=1.0),  # 0.5 s each
        Request("r_S2", 5.0, 512, 1, ttft_deadline_s=1.0),
    ]
    replay(sched, reqs, on_batch=lambda b, now: sched.check_invariants())
    assert sched.blocks.num_used == 0
    return {r.request_id: r.ttft_s for r in reqs}


def steady_stream(policy, gap=0.032, horizon=50.0, **config):
    """A 500K-token prompt at t=0, then a 1500-token request every `gap` seconds.

    Llama-3-8B on 8 x H100 (TP8), 50 ms budget. At this gap the short requests need more of
    the machine than the long one can spare and still meet its deadline: no policy meets
    every deadline here (below this load EDF does, being optimal for a preemptive machine).
    `config`: further SchedulerConfig settings by their flat names (lars_slack, say).
    """
    pred = make_predictor("roofline", "llama-3-8b", "h100", ParallelConfig(tp=8))
    config.setdefault("iteration_budget_s", 0.05)
    sched = ReplicaScheduler(
        SchedulerConfig.from_flat(policy=policy, **config), pred, BlockManager(1 << 19)
    )
    long_ = Request("long", 0.0, 500_000, 1)
    shorts = [Request(f"s{i}", 0.01 + i * gap, 1500, 100) for i in range(int(horizon / gap))]
    replay(sched, [long_, *shorts])
    return long_, shorts
