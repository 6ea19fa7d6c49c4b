"""PLA-Serve: the length boundary, temporal disaggregation, Adaptive Wait-Depth batching of
short prefills, and the pla dispatcher's pools and instance-pressure controller."""

import pytest
from conftest import TOKEN_S, toy_scheduler

from medha.core.batch import BatchResult
from medha.core.config import SchedulerConfig
from medha.core.request import Request
from medha.perf import ParallelConfig, make_predictor
from medha.perf.toy_predictor import FixedCostPredictor
from medha.scheduler.policies.pla_policy import (
    LONG,
    SHORT,
    AdaptiveWaitDepth,
    CostGrid,
    batching_gain,
    boundary_tokens,
)
from medha.sim.dispatchers.pla_dispatcher import PlaDispatcher, PressureController, p90
from medha.sim.replay import replay
from medha.sim.simulator import ClusterConfig, Simulator
from medha.utils.dataclass_cli import flags

BOUNDARY = 100  # toy runs: prompts below 100 tokens are short
CLUSTER_FLAGS = {f.name for f in flags(ClusterConfig)}


def toy_sim(replicas=1, dispatcher="round_robin", **settings):
    """`settings`: flat names of the scheduler's and of the cluster's (the dispatcher's)."""
    settings.setdefault("iteration_budget_s", 1 / 16)
    cluster = {k: settings.pop(k) for k in list(settings) if k in CLUSTER_FLAGS}
    return Simulator(
        ClusterConfig.from_flat(
            replicas=replicas, dispatcher=dispatcher, kv_memory_gb=1.0, **cluster
        ),
        ParallelConfig(),
        SchedulerConfig.from_flat(**settings),
        predictor=FixedCostPredictor(TOKEN_S),
    )


def pla(**config):
    config.setdefault("pla_boundary_tokens", BOUNDARY)
    return toy_scheduler(policy="pla", **config)


def classes(batch, boundary=BOUNDARY):
    return {SHORT if c.request.num_tokens < boundary else LONG for c in batch.prefills}


# ---- the boundary L_m --------------------------------------------------------------------------
def test_boundary_is_where_batching_two_prefills_stops_saving_the_gain():
    pred = make_predictor("roofline", "llama-3-8b", "h100")
    lm = boundary_tokens(pred, 0.25, 8192)
    assert batching_gain(pred, lm - 1) >= 0.25 > batching_gain(pred, lm)
    assert 64 < lm < 1024  # memory-bound short prompts, compute-bound long ones
    assert boundary_tokens(pred, 0.1, 8192) > lm  # a smaller required gain: a longer boundary
    # Without a fixed cost per iteration a batch never saves anything: every prefill is long.
    assert boundary_tokens(FixedCostPredictor(TOKEN_S), 0.25, 8192) == 1


def test_boundary_from_the_config_and_the_predictor():
    assert pla().policy.boundary == BOUNDARY
    sched = toy_scheduler(policy="pla", iteration_s=0.01)  # batching pays up to a length
    p = sched.policy
    assert p.boundary == boundary_tokens(sched.predictor, 0.25, sched.max_model_len) > 1
    assert p.is_short(Request("s", 0.0, p.boundary - 1, 1))
    assert not p.is_short(Request("l", 0.0, p.boundary, 1))


# ---- temporal disaggregation -------------------------------------------------------------------
def test_no_batch_mixes_short_and_long_prefills():
    sched = pla(multi_prefill=True)
    reqs = [Request(f"r{i}", 0.01 * i, 300 if i % 4 == 0 else 20 + i, 6) for i in range(40)]
    seen = []

    def check(batch, end):
        assert len(classes(batch)) <= 1, [c.request for c in batch.prefills]
        seen.append(classes(batch))
        sched.check_invariants()

    replay(sched, reqs, on_batch=check)
    assert {SHORT} in seen and {LONG} in seen
    assert all(r.state.is_done for r in reqs)
    # fcfs on the same load does mix them, so the test above can fail
    mixed = toy_scheduler(policy="fcfs", multi_prefill=True)
    mixes = []
    replay(
        mixed,
        [Request(r.request_id, r.arrival_s, r.prompt_len, 6) for r in reqs],
        on_batch=lambda b, t: mixes.append(len(classes(b)) > 1),
    )
    assert any(mixes)


def test_a_ready_short_batch_cuts_in_between_long_chunks():
    sched = pla()
    sched.add_request(Request("long", 0.0, 1000, 2), 0.0)
    batch = sched.schedule(0.0)  # 64 tokens of the long prompt (1/16 s budget)
    sched.add_request(Request("short", 0.01, 30, 2), 0.01)
    now = batch.predicted_time_s
    sched.update(batch, BatchResult(batch.predicted_time_s), now)
    nxt = sched.schedule(now)
    assert [c.request.request_id for c in nxt.prefills] == ["short"]
    assert sched.policy.last_class == SHORT


def test_a_long_request_about_to_miss_its_deadline_goes_first():
    sched = pla(iteration_budget_s=1 / 16)
    sched.add_request(Request("long", 0.0, 200, 2, ttft_deadline_s=0.3), 0.0)
    sched.add_request(Request("short", 0.0, 30, 2, ttft_deadline_s=5.0), 0.0)
    # slack of the long one: 0.3 - 200/1024 = 0.105 s, above one budget (0.0625): shorts first
    assert [c.request.request_id for c in sched.schedule(0.0).prefills] == ["short"]
    sched2 = pla(iteration_budget_s=1 / 16)
    sched2.add_request(Request("long", 0.0, 200, 2, ttft_deadline_s=0.25), 0.0)
    sched2.add_request(Request("short", 0.0, 30, 2, ttft_deadline_s=5.0), 0.0)
    # slack 0.055 s < one budget, and its deadline comes first
    assert [c.request.request_id for c in sched2.schedule(0.0).prefills] == ["long"]


# ---- Adaptive Wait-Depth ---------------------------------------------------------------------
def awd_sched(wait_s, depth, **config):
    config.setdefault("min_ttft_deadline_s", 30.0)  # deadlines far away unless a test sets one
    return pla(pla_wait_s=wait_s, pla_depth=depth, pla_adaptive=False, **config)


def test_short_prefills_wait_for_the_depth():
    sched = awd_sched(1.0, 3)
    for i, t in enumerate((0.0, 0.2)):
        sched.add_request(Request(f"s{i}", t, 20, 2), t)
        assert sched.schedule(t) is None  # fewer than D = 3 wait, window open
        assert sched.wake_at() == pytest.approx(1.0)  # the oldest arrived at 0, W = 1 s
    sched.add_request(Request("s2", 0.3, 20, 2), 0.3)
    batch = sched.schedule(0.3)
    assert len(batch.prefills) == 3
    assert sched.policy.awd.dispatches[-1].reason == "depth"


def test_an_aborted_waiting_short_prefill_leaves_nothing_behind():
    sched = awd_sched(1.0, 2)
    sched.add_request(Request("a", 0.0, 20, 2), 0.0)
    assert sched.schedule(0.0) is None and sched.wake_at() == pytest.approx(1.0)
    sched.abort("a", 0.1)
    assert sched.schedule(0.1) is None and sched.wake_at() is None
    sched.check_invariants()
    assert not sched.has_unfinished() and sched.blocks.num_used == 0


def test_short_prefills_go_when_the_window_closes():
    sched = awd_sched(0.5, 8)
    reqs = [Request("a", 0.0, 20, 1), Request("b", 0.1, 20, 1)]
    replay(sched, reqs)
    d = sched.policy.awd.dispatches
    assert [(x.time_s, x.depth, x.reason) for x in d] == [(0.5, 2, "window")]
    assert reqs[0].ttft_s == pytest.approx(0.5 + 40 * TOKEN_S)


def test_short_prefills_go_early_when_a_deadline_is_near():
    sched = awd_sched(10.0, 8)
    r = Request("a", 0.0, 20, 1, ttft_deadline_s=0.3)
    replay(sched, [r])
    # released one budget (1/16 s) plus the batch's time (from its bucket, 24 tokens: rounded
    # up) before the deadline
    release = 0.3 - 1 / 16 - sched.policy.awd.grid.time(20, 1)
    assert release == pytest.approx(0.3 - 1 / 16 - 24 * TOKEN_S)
    assert sched.policy.awd.dispatches[-1].reason == "deadline"
    assert sched.policy.awd.dispatches[-1].time_s == pytest.approx(release)
    assert r.ttft_s <= 0.3


def test_a_long_prefill_runs_while_short_ones_wait():
    sched = awd_sched(1.0, 4)
    sched.add_request(Request("s", 0.0, 20, 2), 0.0)
    sched.add_request(Request("l", 0.0, 500, 2), 0.0)
    batch = sched.schedule(0.0)
    assert [c.request.request_id for c in batch.prefills] == ["l"]


def grid():
    pred = make_predictor("roofline", "llama-3-8b", "h100")
    return CostGrid(pred, boundary_tokens(pred, 0.25, 8192), 0.25, 256)


def test_bucket_grid_prices_batches_and_caps_the_depth_that_pays():
    g = grid()
    assert g.lengths[-1] == g.bucket(10_000) and g.bucket(1) == g.lengths[0]
    short, longest = g.lengths[0], g.lengths[-1]
    assert g.cost[short, 4] < 1.2 * g.cost[short, 1]  # memory-bound: 4 cost about one
    assert g.max_depth[short] > g.max_depth[longest] >= 1


def shorts(n, t0, gap, length=32):
    return [Request(f"s{t0}-{i}", t0 + i * gap, length, 1) for i in range(n)]


@pytest.mark.parametrize("rate", [20.0, 3000.0])
def test_wait_and_depth_adapt_to_the_arrival_rate(rate):
    awd = AdaptiveWaitDepth(
        grid(), wait_s=0.0, depth=1, max_wait_s=0.05, iteration_budget_s=0.05, adaptive=True
    )
    t, gap = 0.0, 1 / rate
    for _ in range(30):  # dispatches of 4 shorts each, arriving `rate` per second
        batch = shorts(4, t, gap)
        t = batch[-1].arrival_s + gap
        awd.observe(batch)
        awd.dispatched(batch, t, "depth")
    assert awd.rate == pytest.approx(rate, rel=0.05)
    if rate < 100:  # a batch takes ~8 ms: nobody arrives meanwhile, so nobody waits
        assert (awd.depth, awd.wait_s) == (1, 0.0)
    else:
        length = awd.grid.bucket(32)
        assert 1 < awd.depth <= awd.grid.max_depth[length]
        assert awd.depth <= 1 + rate * awd.grid.cost[length, awd.depth]
        assert awd.wait_s == pytest.approx(min(0.05, (awd.depth - 1) / rate))


def test_the_simulator_wakes_an_idle_replica_when_the_window_closes():
    sim = toy_sim(
        policy="pla", pla_boundary_tokens=BOUNDARY, pla_wait_s=0.25, pla_depth=4, pla_adaptive=False
    )
    reqs = [Request("a", 1.0, 20, 3)]
    sim.run(reqs)  # without the wake-up event it would stall with the request waiting
    assert reqs[0].ttft_s == pytest.approx(0.25 + 20 * TOKEN_S)


@pytest.mark.parametrize(
    "bad",
    [
        {"pla_boundary_tokens": 0},
        {"pla_batching_gain": 1.0},
        {"pla_wait_s": -1.0},
        {"pla_depth": 0},
        {"pla_max_wait_s": 0.0},
        {"pla_cooldown_s": -1.0},
        {"pla_pressure_low": 0.9, "pla_pressure_high": 0.5},
        {"pla_long_instances": 0},
    ],
)
def test_bad_pla_config_names_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        if next(iter(bad)) in CLUSTER_FLAGS:  # the dispatcher's
            ClusterConfig.from_flat(dispatcher="pla", **bad)
        else:
            SchedulerConfig.from_flat(policy="pla", **bad)


# ---- spatial disaggregation: the pla dispatcher ----------------------------------------------
def pla_cluster(replicas=4, **config):
    config.setdefault("pla_boundary_tokens", BOUNDARY)
    sim = toy_sim(replicas=replicas, dispatcher="pla", policy="pla", **config)
    reps = sim._replicas()
    return sim, reps, PlaDispatcher(reps, sim.cluster, sim.scheduler_config)


def test_requests_are_routed_by_length_to_their_pool():
    _, reps, d = pla_cluster(4)
    assert [d.role[r.replica_id] for r in reps] == [SHORT, SHORT, SHORT, LONG]  # 4 // 4 long
    for i, n in enumerate((BOUNDARY - 1, BOUNDARY, 20, 5000, 60)):
        r = Request(f"r{i}", 0.0, n, 1)
        replica = d.pick(r, 0.0)
        replica.add(r, 0.0)
        assert d.role[replica.replica_id] == (SHORT if n < BOUNDARY else LONG)
    # within the short pool, the least outstanding work
    shorts_got = [len(r.scheduler) for r in reps if d.role[r.replica_id] == SHORT]
    assert shorts_got == [1, 1, 1]


def test_one_replica_serves_both_classes():
    _, reps, d = pla_cluster(1)
    assert d.pick(Request("s", 0.0, 10, 1), 0.0) is reps[0]
    assert d.pick(Request("l", 0.0, 5000, 1), 0.0) is reps[0]


def test_controller_hysteresis_and_cooldown():
    c = PressureController(high=0.5, low=0.25, cooldown_s=5.0)
    sizes = {SHORT: 3, LONG: 2}
    # hot long pool, but the short pool is in the band: no move
    assert c.decide({SHORT: 0.3, LONG: 0.9}, sizes, 0.0) is None
    # both in the band: no move either way
    assert c.decide({SHORT: 0.4, LONG: 0.45}, sizes, 0.0) is None
    assert c.decide({SHORT: 0.1, LONG: 0.9}, sizes, 0.0) == (SHORT, LONG)
    # cool-down: the same imbalance moves nothing until 5 s have passed
    assert c.decide({SHORT: 0.1, LONG: 0.9}, sizes, 4.9) is None
    assert c.decide({SHORT: 0.9, LONG: 0.1}, sizes, 5.0) == (LONG, SHORT)
    # a pool keeps its last instance
    assert c.decide({SHORT: 0.9, LONG: 0.1}, {SHORT: 3, LONG: 1}, 20.0) is None


def test_p90_aggregation():
    assert p90([0.0] * 9 + [1.0]) == pytest.approx(0.1)
    assert p90([0.2]) == 0.2
    assert p90([0.0, 1.0]) == pytest.approx(0.9)


def test_the_dispatcher_moves_one_instance_per_cooldown(monkeypatch):
    _, reps, d = pla_cluster(4, pla_cooldown_s=2.0, pla_window_s=0.4)
    hot = {r.replica_id: (0.9 if d.role[r.replica_id] == LONG else 0.0) for r in reps}
    monkeypatch.setattr(d, "instance_pressure", lambda replica, now: hot[replica.replica_id])
    for t in [0.1 * i for i in range(60)]:  # 6 s of arrivals, the long pool always hot
        d.pick(Request(f"r{t}", t, 20, 1), t)
    times = [m.time_s for m in d.moves]
    assert len(times) == 2  # 3 short instances: two may go, the pool keeps one
    assert all(b - a >= 2.0 for a, b in zip(times, times[1:]))
    assert sorted(d.role.values()) == [LONG, LONG, LONG, SHORT]
    assert all(m.source == SHORT and m.target == LONG for m in d.moves)


def test_a_cluster_run_under_the_pla_dispatcher_finishes_everything():
    sim = toy_sim(
        replicas=3,
        dispatcher="pla",
        policy="pla",
        pla_boundary_tokens=BOUNDARY,
        pla_cooldown_s=0.5,
        pla_window_s=0.5,
        pla_pressure_high=0.2,
        pla_pressure_low=0.1,
    )
    reqs = [Request(f"r{i}", 0.02 * i, 400 if i % 3 == 0 else 30, 8) for i in range(150)]
    result = sim.run(reqs)
    assert all(r.state.is_done and r.num_output_tokens == 8 for r in reqs)
    moves = result.dispatcher.moves
    assert all(b.time_s - a.time_s >= 0.5 for a, b in zip(moves, moves[1:]))
