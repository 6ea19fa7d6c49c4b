"""PLA-Serve (She et al.): the compute-memory boundary L_m(H), temporal disaggregation, Adaptive
Wait-Depth batching (Algorithm 1 and the SLA / token-max modes), the CUDA-graph cost model, and
the pla dispatcher's instance-pressure controller (Algorithm 2). The paper gives formulas and
algorithms, no worked numbers: the cases below are computed by hand from them."""

import math

import pytest
from conftest import TOKEN_S, toy_scheduler

from medha.core.batch import BatchResult
from medha.core.request import Request
from medha.dispatch.pla_dispatcher import PlaDispatcher, PressureController, p90
from medha.perf import ParallelConfig, make_predictor
from medha.perf.graph_predictor import GRAPH_LAUNCH_S, HOST_LAYER_S, next_captured
from medha.perf.toy_predictor import FixedCostPredictor
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.policies.config import PlaSettings
from medha.scheduler.policies.pla_policy import (
    LONG,
    SHORT,
    AdaptiveWaitDepth,
    LatencyModel,
    PlaPolicy,
    calibrate,
    fit_latency_model,
    hol_penalty,
)
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
    config.setdefault("min_ttft_deadline_s", 30.0)  # deadlines far away unless a test sets one
    return toy_scheduler(policy="pla", **config)


def classes(batch, boundary=BOUNDARY):
    return {SHORT if c.request.num_tokens < boundary else LONG for c in batch.prefills}


# ---- the boundary L_m (section 2.1) ----------------------------------------------------------
M = LatencyModel(alpha=1e-9, beta=2e-6, gamma_w=5e-6, gamma_r=1e-7)


def test_first_prefill_boundary_is_gamma_w_minus_beta_over_alpha():
    assert M.boundary(0) == pytest.approx((5e-6 - 2e-6) / 1e-9)  # 3000 tokens
    L = M.boundary(0)
    assert M.t_comp(L) == pytest.approx(M.t_mem(L))
    assert M.t_comp(L / 2) < M.t_mem(L / 2) and M.t_comp(2 * L) > M.t_mem(2 * L)
    # gamma_w <= beta: always compute-bound
    assert LatencyModel(1e-9, 5e-6, 5e-6, 1e-7).boundary(0) == 0.0


def test_re_prefill_boundary_is_the_root_and_saturates_at_gamma_r_over_2_alpha():
    H = 4000
    lin = 2 * 1e-9 * H + 2e-6 - 5e-6
    by_hand = (-lin + math.sqrt(lin * lin + 4 * 1e-9 * 1e-7 * H)) / (2 * 1e-9)
    assert M.boundary(H) == pytest.approx(by_hand)
    assert M.t_comp(by_hand, H) == pytest.approx(M.t_mem(by_hand, H))
    # memory-bound as L -> 0 for any H > 0 (T_mem -> g_r H, T_comp -> 0)
    small = LatencyModel(1e-9, 5e-6, 1e-6, 1e-7)
    assert small.boundary(0) == 0.0 and small.boundary(100) > 0
    # long histories: L_m -> g_r / (2 a) = 50 tokens
    assert M.saturation() == pytest.approx(50.0)
    assert M.boundary(10**9) == pytest.approx(50.0, rel=1e-3)
    # gamma_0 enters as the quadratic's constant term, beside g_r H
    g0 = LatencyModel(1e-9, 2e-6, 5e-6, 0.0, gamma_0=4e-4)
    lin0 = 2e-6 - 5e-6
    assert g0.boundary(0) == pytest.approx((-lin0 + math.sqrt(lin0**2 + 4 * 1e-9 * 4e-4)) / 2e-9)
    assert g0.t_comp(g0.boundary(0)) == pytest.approx(g0.t_mem(g0.boundary(0)))


def test_the_fit_recovers_the_curves():
    samples = [
        (L, H, 3e-9 * L * (L + 2 * H) + 4e-5 * L, 2e-6 * L + 5e-8 * H + 0.007)
        for L in (8, 64, 512, 4096)
        for H in (0, 1000, 8000)
    ]
    m = fit_latency_model(samples)
    assert (m.alpha, m.beta, m.gamma_w, m.gamma_r, m.gamma_0) == pytest.approx(
        (3e-9, 4e-5, 2e-6, 5e-8, 0.007)
    )
    exact = fit_latency_model([(L, H, tc, tm - 0.007) for L, H, tc, tm in samples], False)
    assert exact.gamma_0 == 0.0 and exact.gamma_w == pytest.approx(2e-6)


def test_calibrated_boundary_lies_where_the_paper_profiles_it():
    """Qwen2.5-14B on an H200: within 150-512 tokens (the paper's range from profiling); the
    paper's T_mem as written (no constant) puts L_m^prefill at 0 instead."""
    pred = make_predictor("roofline", "qwen2.5-14b", "h200")
    m = calibrate(pred)
    assert 150 < m.boundary(0) < 512
    assert m.boundary(3000) > 64  # a 64-token turn over a 3,000-token history is short
    assert m.boundary(3000) < m.boundary(0)  # the 2aHL term: history makes compute come sooner
    literal = calibrate(pred, memory_intercept=False)
    assert literal.boundary(0) == 0.0 and literal.gamma_w < literal.beta


def test_hol_penalty_by_hand():
    # lambda 10/s, p = 0.8, rho 0.5, S_l = 0.2 s, S_s = 0.01 s
    assert hol_penalty(10, 0.8, 0.5, 0.2, 0.01) == pytest.approx(10 * 0.16 * 0.19**2 / 1.0)


def test_re_prefill_is_classed_by_its_uncached_tokens():
    pol = PlaPolicy(SchedulerConfig(policy="pla"))
    pol.bind(make_predictor("roofline", "qwen2.5-14b", "h200"), None, 32768)
    lm = pol.boundary(0)
    r = Request("turn", 0.0, 3064, 1)
    pol._peek = lambda req: 3000  # the cache holds the 3,000-token history
    assert pol.is_short(r)
    pol._history.clear()
    pol._peek = lambda req: 0
    assert not pol.is_short(r)
    assert pol.is_short(Request("s", 0.0, int(lm) - 1, 1))


def test_the_prefix_cache_gives_the_policy_its_history():
    sched = toy_scheduler(
        policy="pla", pla_boundary_tokens=BOUNDARY, prefix_cache="device", num_blocks=4096
    )
    first = Request.from_tokens("t1", 0.0, list(range(1000)), 1)
    replay(sched, [first])
    nxt = Request.from_tokens("t2", 1.0, list(range(1000)) + [7] * 40, 1)
    sched.add_request(nxt, 1.0)
    assert sched.policy.history(nxt) >= 992 - 16  # full pages of the first prompt
    assert sched.policy.is_short(nxt)


# ---- temporal disaggregation -------------------------------------------------------------------
def test_no_batch_mixes_short_and_long_prefills():
    sched = pla(multi_prefill=True)
    reqs = [Request(f"r{i}", 0.01 * i, 300 if i % 4 == 0 else 20 + i, 6) for i in range(40)]
    seen = []

    def check(batch, end):
        assert len(classes(batch)) <= 1, [c.request for c in batch.prefills]
        assert (
            len({c.request.request_id for c in batch.prefills if c.request.num_tokens >= 100}) <= 1
        )
        seen.append(classes(batch))
        sched.check_invariants()

    replay(sched, reqs, on_batch=check)
    assert {SHORT} in seen and {LONG} in seen
    assert all(r.state.is_done for r in reqs)
    mixed = toy_scheduler(policy="fcfs", multi_prefill=True)  # fcfs does mix them
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
    batch = sched.schedule(0.0)
    sched.add_request(Request("short", 0.01, 30, 2, ttft_deadline_s=1.0), 0.01)
    now = batch.predicted_time_s
    sched.update(batch, BatchResult(batch.predicted_time_s), now)
    # the short one waits for depth D (64) until W_max or T_max; then it goes before the long
    # (SLA-first: its deadline is the earlier)
    for t in (now, now + 0.06, now + 0.2):
        nxt = sched.schedule(t)
        ids = [c.request.request_id for c in nxt.prefills]
        sched.update(nxt, BatchResult(nxt.predicted_time_s), t + nxt.predicted_time_s)
        if ids == ["short"]:
            break
    assert ids == ["short"] and sched.policy.last_class == SHORT


def test_sla_first_between_the_classes():
    sched = pla()
    sched.add_request(Request("long", 0.0, 200, 2, ttft_deadline_s=0.3), 0.0)
    sched.add_request(Request("short", 0.0, 30, 2, ttft_deadline_s=0.035), 0.0)
    # its slack, 0.035 - 30 x TOKEN_S, is below sigma: it goes now, before the long (earlier
    # deadline)
    assert [c.request.request_id for c in sched.schedule(0.0).prefills] == ["short"]
    sched2 = pla()
    sched2.add_request(Request("long", 0.0, 200, 2, ttft_deadline_s=0.3), 0.0)
    sched2.add_request(Request("short", 0.0, 30, 2, ttft_deadline_s=5.0), 0.0)
    # the short batch is not ready (waiting for depth): the long one runs meanwhile
    assert [c.request.request_id for c in sched2.schedule(0.0).prefills] == ["long"]


# ---- Adaptive Wait-Depth (Algorithm 1) ---------------------------------------------------------
def awd(mode="awd", service=0.01, **settings):
    s = PlaSettings(mode=mode, **settings)
    return AdaptiveWaitDepth(
        s, lambda b: service, (8, 16, 32, 64, 128, 256), (1, 2, 4, 8, 16, 32, 64)
    )


def req(i, t, n=20, deadline=30.0):
    r = Request(f"r{i}", t, n, 1, ttft_deadline_s=deadline)
    r.deadline_s, r.admission_seq = t + deadline, i  # what the request table sets
    return r


def test_initial_depth_is_the_deepest_captured_shape_within_the_budget():
    assert awd().depth == 64  # 8 tokens x 64 within M = 16384
    assert awd(memory_tokens=256).depth == 32  # 8 x 32 = 256


def test_algorithm_1_window_from_the_deadlines_then_tau_and_depth_updates():
    a = awd(w_max_s=0.05)
    shorts = [req(0, 0.0, deadline=0.03)]  # DDL - t - S = 0.02 s
    assert a.window([shorts[0]], shorts, 0.0) == pytest.approx(0.02)  # W_0 = clip(0.02)
    batch, why, at = a.decide(shorts, 0.0)
    assert why is None and at == pytest.approx(0.01)  # slack 0.02 - sigma 0.01 comes first
    batch, why, _ = a.decide(shorts, 0.01)
    assert why == "slack"
    a.dispatched(batch, shorts, 0.01, why)
    assert a.depth == 1  # d = 1 < D = 64: D <- d
    # a batch that reaches D: W <- clip(tau), tau the time it took
    a.depth = 2
    two = [req(1, 1.0), req(2, 1.004)]
    batch, why, _ = a.decide(two, 1.004)
    assert why == "depth" and len(batch) == 2
    a.dispatched(batch, two, 1.004, why)
    assert a.window_s == pytest.approx(1.004 - 1.0)


def test_head_of_line_wait_bounds_the_wait():
    a = awd(mode="sla", t_max_s=0.1, w_max_s=1.0)
    shorts = [req(0, 0.0)]
    assert a.decide(shorts, 0.05)[1] is None
    assert a.decide(shorts, 0.1)[1] == "hol"


def test_sla_mode_window_is_min_of_w_sla_and_w_gr():
    a = awd(mode="sla", w_max_s=1.0, delta_s=0.01, service=0.01)
    a.rate, a.depth = 100.0, 5
    shorts = [req(0, 0.0, deadline=0.5)]
    # W_GR = (5 - 1) / 100 = 0.04; W_SLA = 0.5 - 0 - 0.01 - 0.01 = 0.48
    assert a.window(shorts, shorts, 0.0) == pytest.approx(0.04)
    a.rate = 1.0  # W_GR = 4 s: W_SLA bounds it
    assert a.window(shorts, shorts, 0.0) == pytest.approx(0.48)
    a.rate = 0.0  # W_GR = 4 / epsilon (1/s)
    assert a.window(shorts, shorts, 0.0) == pytest.approx(0.48)


def test_sla_mode_window_is_bounded_by_algorithm_1s_adapted_window():
    """In the SLA mode Algorithm 1's W is live: after a batch reached D in tau, the window
    never runs longer than clip(tau), however loose W_SLA and W_GR are."""
    a = awd(mode="sla", w_max_s=1.0, delta_s=0.01, service=0.01)
    a.rate, a.depth = 1.0, 2
    two = [req(0, 0.0), req(1, 0.003)]
    batch, why, _ = a.decide(two, 0.003)
    assert why == "depth"
    a.dispatched(batch, two, 0.003, why)
    assert a.window_s == pytest.approx(0.003)
    one = [req(2, 1.0)]
    # W_GR = (2 - 1) / 1 = 1 s, W_SLA = 29.98 s: Algorithm 1's 3 ms is the tighter
    assert a.window(one, one, 1.0) == pytest.approx(0.003)
    batch, why, at = a.decide(one, 1.0)
    assert why is None and at == pytest.approx(1.003)
    assert a.decide(one, 1.003)[1] == "window"


def test_bucket_first_grouping_stops_where_padding_costs_more_than_a_launch():
    a = awd()
    a.service_s = lambda b: 0.008 + 2e-5 * a.padded_tokens(b)  # a launch, and padded tokens
    shorts = [req(0, 0.0, 60), req(1, 0.1, 200), req(2, 0.2, 50), req(3, 0.3, 10), req(4, 0.4, 30)]
    # the head's bucket (64: r0, r2), then shorter buckets nearest first (r4 in 32, r3 in 16),
    # padded to 4 x 64 = 256 tokens; the 200-token one would pad the batch to 8 x 256 = 2,048
    # tokens, 0.049 s against 0.013 + 0.013 apart: it waits for a batch of its own
    assert [r.request_id for r in a.group(shorts)] == ["r0", "r2", "r4", "r3"]
    a.service_s = lambda b: 0.01  # a fixed cost: everyone joins, longer buckets last
    assert [r.request_id for r in a.group(shorts)] == ["r0", "r2", "r4", "r3", "r1"]


def test_token_max_mode_waits_for_m_s_padded_tokens():
    a = awd(mode="token-max", token_max_tokens=256, t_max_s=5.0)
    shorts = [req(i, 0.01 * i, 60) for i in range(3)]  # 64 x 4 = 256 padded tokens
    assert a.decide(shorts[:2], 0.02)[1] is None  # 64 x 2 = 128
    assert a.decide(shorts, 0.03)[1] == "tokens"


def test_an_idle_replica_is_woken_when_the_window_closes():
    sim = toy_sim(
        policy="pla",
        pla_boundary_tokens=BOUNDARY,
        pla_adaptive=False,
        pla_w_max_s=0.25,
        pla_t_max_s=1.0,
        min_ttft_deadline_s=30.0,
    )
    reqs = [Request("a", 1.0, 20, 3)]
    sim.run(reqs)  # without the wake-up event it would stall with the request waiting
    assert reqs[0].ttft_s == pytest.approx(0.25 + 20 * TOKEN_S)


def test_an_aborted_waiting_short_prefill_leaves_nothing_behind():
    sched = pla()
    sched.add_request(Request("a", 0.0, 20, 2), 0.0)
    assert sched.schedule(0.0) is None and sched.wake_at() > 0.0
    sched.abort("a", 0.01)
    assert sched.schedule(0.01) is None and sched.wake_at() is None
    sched.check_invariants()
    assert not sched.has_unfinished() and sched.blocks.num_used == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"pla_boundary_tokens": 0},
        {"pla_mode": "fast"},
        {"pla_w_max_s": 0.0},
        {"pla_slack_s": -1.0},
        {"pla_memory_tokens": 0},
        {"pla_cooldown_s": -1.0},
        {"pla_tau": -0.1},
        {"pla_aggregator": "median"},
        {"pla_long_instances": 0},
    ],
)
def test_bad_pla_config_names_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        if next(iter(bad)) in CLUSTER_FLAGS:  # the dispatcher's
            ClusterConfig.from_flat(dispatcher="pla", **bad)
        else:
            SchedulerConfig.from_flat(policy="pla", **bad)


# ---- the CUDA-graph cost model -----------------------------------------------------------------
def test_graph_shapes_pad_to_the_next_captured_size():
    assert next_captured(5, (1, 2, 4, 8)) == 8 and next_captured(9, (1, 2, 4, 8)) is None
    g = make_predictor("roofline-graph", "qwen2.5-7b", "h200")
    assert g.graph_shape(33, 3) == (64, 4)
    assert g.graph_shape(257, 3) is None and g.graph_shape(8, 65) is None
    # a batch of 3 x 33 tokens costs the graph of 4 x 64
    assert g.shape_time([(33, 0)] * 3) == pytest.approx(g.graph_time((64, 4), [0, 0, 0]))


def test_eager_steps_pay_the_hosts_launches_and_graphs_one_replay():
    e = make_predictor("roofline-eager", "qwen2.5-7b", "h200")
    g = make_predictor("roofline-graph", "qwen2.5-7b", "h200")
    r = make_predictor("roofline", "qwen2.5-7b", "h200")
    host = 28 * HOST_LAYER_S
    over = r.hardware.iteration_overhead_s
    gpu = r.shape_time([(8, 0)]) - over
    assert gpu < host  # a small batch on an H200 is host-bound when eager
    assert e.shape_time([(8, 0)]) == pytest.approx(host + gpu / 28 + over)
    assert g.shape_time([(8, 0)]) == pytest.approx(gpu + over + GRAPH_LAUNCH_S)
    assert g.shape_time([(8, 0)]) < 0.8 * e.shape_time([(8, 0)])
    # a long chunk, or decodes in the batch, run eagerly under both
    assert g.shape_time([(1000, 0)]) == e.shape_time([(1000, 0)])
    assert g.shape_time([(8, 0)], [100]) == e.shape_time([(8, 0)], [100])
    # GPU-bound batches: within a few percent either way
    assert g.shape_time([(256, 0)] * 64) == pytest.approx(e.shape_time([(256, 0)] * 64), rel=0.05)
    # the plain roofline is untouched
    assert r.shape_time([(8, 0)]) == pytest.approx(gpu + over)


def test_graph_model_against_the_h100_measurement():
    """docs/cuda_graph_prefill_h100.json: eager / graph of a Qwen2.5-7B-shaped forward on the
    lent H100, 1.13 at 8 x 1 and 1.01 at 256 x 64 (each plus the 1 ms step overhead)."""
    e = make_predictor("roofline-eager", "qwen2.5-7b", "h100")
    g = make_predictor("roofline-graph", "qwen2.5-7b", "h100")
    small = e.shape_time([(8, 0)]) / g.shape_time([(8, 0)])
    big = e.shape_time([(256, 0)] * 64) / g.shape_time([(256, 0)] * 64)
    assert 1.03 < small < 1.13 and 1.0 < big < 1.05


# ---- the pla dispatcher: Algorithm 2 -----------------------------------------------------------
def pla_cluster(replicas=4, **config):
    config.setdefault("pla_boundary_tokens", BOUNDARY)
    config.setdefault("pla_long_instances", 1)
    sim = toy_sim(replicas=replicas, dispatcher="pla", policy="pla", **config)
    reps = sim._replicas()
    return sim, reps, PlaDispatcher(reps, sim.cluster, sim.scheduler_config)


def test_requests_are_routed_by_length_to_their_pool():
    _, reps, d = pla_cluster(4)
    assert [d.role[r.replica_id] for r in reps] == [SHORT, SHORT, SHORT, LONG]
    for i, n in enumerate((BOUNDARY - 1, BOUNDARY, 20, 5000, 60)):
        r = Request(f"r{i}", 0.0, n, 1)
        replica = d.pick(r, 0.0)
        replica.add(r, 0.0)
        assert d.role[replica.replica_id] == (SHORT if n < BOUNDARY else LONG)
    assert [len(r.scheduler) for r in reps if d.role[r.replica_id] == SHORT] == [1, 1, 1]


def test_the_pools_start_half_and_half():
    for n, long in ((2, 1), (3, 1), (8, 4)):
        _, reps, d = pla_cluster(n, pla_long_instances=None)
        assert [d.role[r.replica_id] for r in reps].count(LONG) == long


def test_one_replica_serves_both_classes():
    _, reps, d = pla_cluster(1)
    assert d.pick(Request("s", 0.0, 10, 1), 0.0) is reps[0]
    assert d.pick(Request("l", 0.0, 5000, 1), 0.0) is reps[0]


def test_controller_moves_on_relative_pressure_with_hysteresis_n_min_and_cooldown():
    c = PressureController(tau=0.2, n_min=1, cooldown_s=5.0)
    sizes = {SHORT: 3, LONG: 2}
    assert c.decide({SHORT: 1.1, LONG: 1.0}, sizes, 0.0) is None  # within (1 + tau)
    assert c.decide({SHORT: 1.3, LONG: 1.0}, sizes, 0.0) == (LONG, SHORT)
    assert c.decide({SHORT: 0.1, LONG: 0.9}, sizes, 4.9) is None  # cool-down
    assert c.decide({SHORT: 0.1, LONG: 0.9}, sizes, 5.0) == (SHORT, LONG)
    assert c.decide({SHORT: 0.9, LONG: 0.1}, {SHORT: 3, LONG: 1}, 20.0) is None  # n_min
    assert c.decide({SHORT: -0.1, LONG: -0.5}, sizes, 30.0) is None  # calm pools stay
    assert PressureController(0.2, 2, 0.0).decide({SHORT: 2, LONG: 0.1}, sizes, 0.0) is None


def test_instance_pressure_is_alpha_q_plus_beta_e_minus_gamma_u(monkeypatch):
    _, reps, d = pla_cluster(2, pla_weight_queue=2.0, pla_weight_slo=3.0, pla_weight_util=0.5)
    monkeypatch.setattr(d, "signals", lambda replica, now: (0.4, 0.2, 0.8))
    assert d.instance_pressure(reps[0], 0.0) == pytest.approx(2 * 0.4 + 3 * 0.2 - 0.5 * 0.8)


def test_p90_aggregation():
    assert p90([0.0] * 9 + [1.0]) == pytest.approx(0.1)
    assert p90([0.0, 1.0]) == pytest.approx(0.9)


def test_the_dispatcher_moves_one_instance_per_cooldown(monkeypatch):
    _, reps, d = pla_cluster(4, pla_cooldown_s=2.0, pla_period_s=0.1)
    hot = {r.replica_id: (0.9 if d.role[r.replica_id] == LONG else 0.1) for r in reps}
    monkeypatch.setattr(d, "instance_pressure", lambda replica, now: hot[replica.replica_id])
    for t in [0.1 * i for i in range(60)]:
        d.tick(t)
    times = [m.time_s for m in d.moves]
    assert len(times) == 2  # 3 short instances: two may go, the pool keeps n_min = 1
    assert all(b - a >= 2.0 for a, b in zip(times, times[1:]))
    assert sorted(d.role.values()) == [LONG, LONG, LONG, SHORT]


def served_on(result):
    """request id -> the replicas that ran its prefill chunks."""
    log, on = result.log, {}
    for iteration, request_id in zip(log.chunk_iteration, log.chunk_request):
        on.setdefault(request_id, set()).add(log.replica[iteration])
    return on


def test_a_cluster_run_under_the_pla_dispatcher_finishes_everything():
    sim = toy_sim(
        replicas=3, dispatcher="pla", policy="pla", pla_boundary_tokens=BOUNDARY, pla_cooldown_s=0.5
    )
    reqs = [Request(f"r{i}", 0.02 * i, 400 if i % 3 == 0 else 30, 8) for i in range(150)]
    result = sim.run(reqs)
    assert all(r.state.is_done and r.num_output_tokens == 8 for r in reqs)
    # Replicas 0, 1 start short and 2 long (n // 4 = 0, at least one). The long load is ~6
    # replicas' worth: at the first control with a queue (t = period 0.5; at t = 0 every psi is
    # 0) replica 0, the least-pressured short one, joins the long pool; then n_min = 1 keeps
    # replica 1 short, and the long pool stays the more pressed.
    moves = result.dispatcher.moves
    assert [(m.time_s, m.replica_id, m.source, m.target) for m in moves] == [(0.5, 0, SHORT, LONG)]
    # ... and the move routes: the moved replica takes long prompts from then on, and no short.
    on = served_on(result)

    def replicas(long, after):
        return set().union(
            *(
                on[r.request_id]
                for r in reqs
                if (r.prompt_len >= BOUNDARY) == long and (r.arrival_s >= 0.5) == after
            )
        )

    assert replicas(long=False, after=False) == {0, 1}
    assert replicas(long=True, after=True) == {0, 2}
    assert replicas(long=False, after=True) == {1}
    # Long prompts that were still queued at the move went to the moved instance too: they
    # waited in the long class's queue, not on replica 2.
    assert replicas(long=True, after=False) == {0, 2}
    pulled_late = [
        r for r in reqs if r.prompt_len >= BOUNDARY and r.arrival_s < 0.5 and 0 in on[r.request_id]
    ]
    assert pulled_late and all(r.first_scheduled_s >= 0.5 for r in pulled_late)


def test_the_controller_runs_with_no_arrivals():
    """Every request at t = 0 (the paper's distillation run): the controller, woken by its own
    period, moves instances to the loaded pool while the queue drains."""
    sim = toy_sim(
        replicas=4,
        dispatcher="pla",
        policy="pla",
        pla_boundary_tokens=BOUNDARY,
        pla_cooldown_s=0.5,
        pla_period_s=0.25,
        min_ttft_deadline_s=1e6,
        pla_mode="token-max",
        pla_long_instances=1,
    )
    reqs = [Request(f"l{i}", 0.0, 400, 1) for i in range(60)] + [
        Request(f"s{i}", 0.0, 30, 1) for i in range(20)
    ]
    result = sim.run(reqs)
    assert all(r.state.is_done for r in reqs)
    moves = result.dispatcher.moves
    # 3 short, 1 long at the start; the shorts drain at once and two short instances join the
    # long pool, one per cool-down, at control periods after t = 0
    assert [(m.source, m.target) for m in moves] == [(SHORT, LONG), (SHORT, LONG)]
    assert 0 < moves[0].time_s and moves[1].time_s - moves[0].time_s >= 0.5
    on = served_on(result)
    assert len(set().union(*(on[r.request_id] for r in reqs if r.prompt_len >= BOUNDARY))) == 3


def test_with_n_min_0_a_pool_empties_and_its_queue_calls_an_instance_back():
    """n_min = 0: with no short prompt, the short instance joins the long pool; shorts that
    arrive later wait in their queue, whose pressure (the pool's: its work and its requests'
    wait against their 20 ms deadlines) brings an instance back."""
    sim = toy_sim(
        replicas=2,
        dispatcher="pla",
        policy="pla",
        pla_boundary_tokens=BOUNDARY,
        pla_cooldown_s=0.5,
        pla_period_s=0.25,
        pla_n_min=0,
        pla_long_instances=1,
        min_ttft_deadline_s=1e6,
    )
    reqs = [Request(f"l{i}", 0.0, 400, 1) for i in range(8)]
    reqs += [Request(f"s{i}", 1.0 + 0.01 * i, 30, 1, ttft_deadline_s=0.02) for i in range(20)]
    result = sim.run(reqs)
    assert all(r.state.is_done for r in reqs)
    moves = [(m.time_s, m.source, m.target) for m in result.dispatcher.moves]
    assert moves[0] == (0.25, SHORT, LONG)  # both instances long: the short pool is empty
    back = [t for t, source, target in moves if target == SHORT]
    assert back and 1.0 <= back[0] <= 1.0 + 0.5  # the first control once shorts queue
    shorts = [r for r in reqs if r.prompt_len < BOUNDARY]
    assert all(r.first_scheduled_s >= back[0] for r in shorts)


def test_a_held_request_dropped_leaves_its_queue_and_its_work():
    _, reps, d = pla_cluster(2)
    reqs = [Request(f"l{i}", 0.01 * i, 400 + i, 1) for i in range(3)]
    assert all(d.route(r, r.arrival_s) is None for r in reqs) and d.held() == 3
    work = d._queue_state(LONG, 0.1)[0]
    assert d.drop("l1") and not d.drop("l1") and d.held() == 2
    assert d._queue_state(LONG, 0.1)[0] < work
    long = next(r for r in reps if d.role[r.replica_id] == LONG)
    assert [r.request_id for r in d.pull([long], 0.1)[long.replica_id]] == ["l0"]


def test_a_short_instance_gathering_a_batch_takes_the_next_arrivals():
    """Shorts 1 ms apart, deadlines far: the instance that took the first holds it for the
    window and takes the ones after it (pulled, not spread over the idle short instances as
    pushing to the least loaded would), and one long instance takes one long at a time."""
    sim = toy_sim(
        replicas=3,
        dispatcher="pla",
        policy="pla",
        pla_boundary_tokens=BOUNDARY,
        pla_w_max_s=0.05,
        min_ttft_deadline_s=30.0,
    )
    reqs = [Request(f"s{i}", 0.001 * i, 30, 1) for i in range(8)]
    result = sim.run(reqs)
    on = served_on(result)
    assert {rid for r in reqs for rid in on[r.request_id]} == {0}
    depths = [d.depth for d in result.dispatcher.replicas[0].scheduler.policy.awd.dispatches]
    assert depths[0] == 8


def test_the_pla_dispatcher_waits_its_cooldown_between_moves_in_a_cluster_run():
    # A burst of long prompts, then of short ones: the long pool gains replica 0 at the first
    # control with a queue, and the short burst (1 s on) would take one back at 1.62 s (as it
    # does with no cool-down); the 2 s cool-down holds it to 2.1 s or later. The period (0.1 s)
    # is far below the cool-down, so the spacing is the cool-down's, not the period's.
    sim = toy_sim(
        replicas=3,
        dispatcher="pla",
        policy="pla",
        pla_boundary_tokens=BOUNDARY,
        pla_cooldown_s=2.0,
        pla_period_s=0.1,
    )
    reqs = [Request(f"l{i}", 0.05 * i, 400, 8) for i in range(10)]
    reqs += [Request(f"s{i}", 1.0 + 0.01 * i, 30, 8) for i in range(300)]
    moves = sim.run(reqs).dispatcher.moves
    assert all(r.state.is_done and r.num_output_tokens == 8 for r in reqs)
    assert [(m.source, m.target) for m in moves] == [(SHORT, LONG), (LONG, SHORT)]
    assert moves[0].time_s == pytest.approx(0.1)
    assert moves[1].time_s - moves[0].time_s >= 2.0
    assert moves[1].time_s < moves[0].time_s + 2.0 + 0.1 + 0.01  # the first control after it


# ---- closed-loop clients ---------------------------------------------------------------------
def test_closed_loop_clients_send_their_next_request_when_one_finishes():
    sim = toy_sim(policy="fcfs")
    left = {"c0": 3, "c1": 3}

    def next_of(r, now):
        client = r.request_id.split("-")[0]
        left[client] -= 1
        return [Request(f"{client}-{left[client]}", now, 50, 1)] if left[client] else []

    result = sim.run([Request("c0-x", 0.0, 50, 1), Request("c1-x", 0.0, 50, 1)], on_finish=next_of)
    assert len(result.requests) == 6 and all(r.state.is_done for r in result.requests)
    # each client's requests one after another: the next arrives when the last finished
    by_client = sorted(
        (r for r in result.requests if r.request_id.startswith("c0")), key=lambda r: r.arrival_s
    )
    assert all(b.arrival_s == a.finish_s for a, b in zip(by_client, by_client[1:]))


def test_the_cheaper_graph_executor_falls_back_to_eager_when_padding_costs_more():
    g = make_predictor("roofline-graph", "qwen2.5-14b", "h200")
    m = make_predictor("roofline-graph-min", "qwen2.5-14b", "h200")
    e = make_predictor("roofline-eager", "qwen2.5-14b", "h200")
    padded = [(48, 2000)] * 5  # pads to 64 x 8: 512 tokens of compute for 240
    assert g.shape_time(padded) > e.shape_time(padded) == m.shape_time(padded)
    tiny = [(8, 0)]  # host-bound: the graph wins either way
    assert m.shape_time(tiny) == g.shape_time(tiny) < e.shape_time(tiny)


def test_long_prefills_run_one_at_a_time_unless_told_otherwise():
    for mode, expect in (("one", 1), ("all", 3)):
        sched = pla(pla_long_batch=mode, multi_prefill=True, iteration_budget_s=1.0)
        for i in range(3):
            sched.add_request(Request(f"l{i}", 0.0, 200, 1), 0.0)
        assert len(sched.schedule(0.0).prefills) == expect
