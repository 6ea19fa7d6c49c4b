"""Deferred prefill (issue 7): the admission rule, the analytic model, the simulated curve, the
command."""

import math
import random

import pytest
from conftest import toy_scheduler

from medha.analysis.deferred_prefill import (
    Costs,
    DeferredSystem,
    StepTimes,
    approx_throughput,
    best_k,
    cycle_means,
    fit_costs,
    renewal_throughput,
)
from medha.analysis.deferred_prefill_sim import simulate_point
from medha.cli import main
from medha.core.batch import BatchResult
from medha.core.request import Request
from medha.perf import ParallelConfig
from medha.perf.toy_predictor import FixedCostPredictor
from medha.scheduler.config import SchedulerConfig
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig, build_requests

# ---- the admission rule ----------------------------------------------------------------------

# Room for every request below at once several times over, so memory never decides an
# admission, and a block check per batch of 1,024 blocks rather than toy_scheduler's 65,536.
BLOCKS = 1024


def drive(sched, requests):
    """Run to the end; per batch: (ids starting their prefill, running ids before it,
    departures so far)."""
    for r in requests:
        sched.add_request(r, 0.0)
    now, departed, log = 0.0, 0, []
    while sched.has_unfinished():
        running = {r.request_id for r in sched.live_requests() if r.num_scheduled}
        batch = sched.schedule(now)
        starts = [c.request.request_id for c in batch.prefills if c.start == 0]
        log.append((batch, starts, running, departed))
        now += batch.predicted_time_s
        departed += len(sched.update(batch, BatchResult(batch.predicted_time_s), now))
        sched.check_invariants()
    return log


@pytest.mark.parametrize(
    "k,cap,prefill_only", [(1, 4, False), (3, 4, True), (5, 8, False), (8, 8, True)]
)
def test_no_prefill_is_admitted_before_k_departures_and_the_cap_holds(k, cap, prefill_only):
    rng = random.Random(k * cap)
    sched = toy_scheduler(
        policy="deferred",
        chunking="none",
        num_blocks=BLOCKS,
        departure_threshold=k,
        batch_cap=cap,
        max_num_seqs=cap,
        prefill_only_iterations=prefill_only,
    )
    reqs = [Request(f"r{i}", 0.0, rng.randint(4, 40), rng.randint(1, 30)) for i in range(40)]
    log = drive(sched, reqs)
    last_departed, groups = None, 0
    for _, starts, running, departed in log:
        if starts:
            groups += 1
            # the first group, or K departures since the last one, or an empty batch
            assert last_departed is None or departed - last_departed >= k or not running
            assert len(running) + len(starts) <= cap
            last_departed = departed
        assert len(running) <= cap
    assert all(r.state.is_done for r in reqs) and sched.blocks.num_used == 0
    assert groups <= 1 + len(reqs) // k


def test_k1_refills_every_departure_at_once():
    sched = toy_scheduler(
        policy="deferred",
        chunking="none",
        num_blocks=BLOCKS,
        departure_threshold=1,
        batch_cap=4,
        max_num_seqs=4,
    )
    reqs = [Request(f"r{i}", 0.0, 8, 2 + i) for i in range(12)]
    log = drive(sched, reqs)
    # each batch after a departure starts exactly as many prompts as left (backlog permitting)
    starts_after = [len(s) for (_, s, _, _) in log[1:]]
    departures = [b - a for (_, _, _, a), (_, _, _, b) in zip(log, log[1:])]
    waiting = len(reqs) - 4
    for n_left, n_started in zip(departures, starts_after):
        assert n_started == min(n_left, waiting)
        waiting -= n_started


def test_prefill_only_iterations_never_mix_prefills_and_decodes():
    sched = toy_scheduler(
        policy="fcfs",
        chunking="none",
        num_blocks=BLOCKS,
        prefill_only_iterations=True,
        max_num_seqs=6,
    )
    reqs = [Request(f"r{i}", 0.0, 8 + i, 5) for i in range(20)]
    log = drive(sched, reqs)
    assert all(not (b.prefills and b.decodes) for b, *_ in log)
    assert all(len(running) <= 6 for _, _, running, _ in log)
    assert sum(1 for b, *_ in log if b.prefills) >= 2


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"batch_cap": 300}, "batch_cap .300. exceeds max_num_seqs"),
        ({"departure_threshold": 9, "batch_cap": 8}, "departure_threshold .9. exceeds"),
        ({"departure_threshold": 0}, "departure_threshold must be a positive integer"),
    ],
)
def test_bad_deferred_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig.from_flat(policy="deferred", **fields)


# ---- the analytic model ----------------------------------------------------------------------


def test_prop1_optimum_matches_the_hand_derivation():
    # With ln(1 - alpha) = -1, 1/rho = (c_p - c_d ln(1 - K/C)) / K + const; setting the
    # derivative to zero gives c_p / c_d = K/(C-K) + ln(1 - K/C): at C=100, K=50 that is
    # 1 - ln 2. So c_p = 1 - ln 2, c_d = 1 puts K* at exactly 50.
    system = DeferredSystem(100, 10, 1 / (1 - math.exp(-1)))
    costs = Costs(c_p=1 - math.log(2), t_p=1e-3, c_d=1.0, t_d=1e-3)
    assert best_k(lambda k: approx_throughput(costs, system, k), 100) == 50
    # no fixed prefill cost: K = 1; no fixed decode cost: wait for the whole batch
    assert best_k(lambda k: approx_throughput(Costs(0, 1e-3, 1, 1e-3), system, k), 100) == 1
    assert best_k(lambda k: approx_throughput(Costs(1, 1e-3, 0, 1e-3), system, k), 100) == 99


def table(cap, f):
    import numpy as np

    return np.array([[f(n), 0.0] for n in range(cap + 1)])


def test_renewal_cycle_of_k1_has_the_closed_form():
    import numpy as np

    cap, alpha = 20, 0.1
    steps = table(cap, lambda n: 1.0)  # counts the cycle's steps
    ends = np.array([[0.0, d] for d in range(cap + 1)], float)  # D at the end
    expected_steps, expected_d = cycle_means(1, cap, alpha, steps, ends)
    any_leaves = 1 - (1 - alpha) ** cap
    assert expected_steps == pytest.approx(1 / any_leaves)
    assert expected_d == pytest.approx(cap * alpha / any_leaves)


def toy_system():
    # a 10 ms fixed cost per iteration, 0.1 ms per token: deferring clearly pays
    return DeferredSystem(cap=64, prompt_tokens=16, mean_output=100.0), FixedCostPredictor(
        token_s=1e-4, iteration_s=0.01
    )


def test_fit_recovers_linear_costs_and_models_agree_in_the_middle():
    system, predictor = toy_system()
    times = StepTimes(predictor, system)
    c = fit_costs(times, 8)
    assert (c.c_p, c.t_p, c.c_d, c.t_d) == pytest.approx((0.01, 1e-4, 0.01, 1e-4))
    for k in (8, 12, 16):  # the fluid limit is close once K departures take a few steps
        assert approx_throughput(c, system, k) == pytest.approx(
            renewal_throughput(times, k), rel=0.03
        )


def test_simulated_curve_peaks_inside_and_follows_the_renewal_model():
    system, predictor = toy_system()
    times = StepTimes(predictor, system)
    cluster = ClusterConfig(model="llama-3-8b", hardware="h100")  # replaced by the toy below
    sim = {
        k: simulate_point(system, k, cluster, ParallelConfig(), predictor, 2000).requests_per_s
        for k in (1, 4, 9, 20, 63)
    }
    best = max(sim, key=sim.get)
    assert best not in (1, 63)
    k_star = best_k(lambda k: renewal_throughput(times, k), system.cap)
    assert 4 <= k_star <= 20
    for k, rps in sim.items():
        assert rps == pytest.approx(renewal_throughput(times, k), rel=0.04)


def test_geometric_outputs_have_the_asked_mean():
    cfg = WorkloadConfig(
        trace="synthetic",
        prompt_len=10,
        output_len=50,
        output_distribution="geometric",
        qps=1.0,
        num_requests=4000,
    )
    outs = [r.max_tokens for r in build_requests(cfg, 1 << 20)]
    assert min(outs) == 1 and sum(outs) / len(outs) == pytest.approx(50, rel=0.05)
    assert sum(o == 1 for o in outs) / len(outs) == pytest.approx(1 / 50, abs=0.01)
    with pytest.raises(ValueError, match="output_distribution"):
        WorkloadConfig(output_distribution="zipf")


# ---- the command -----------------------------------------------------------------------------


def medha(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_analyze_prints_the_curve_and_k_star(capsys):
    code, out, err = medha(
        capsys,
        "analyze",
        "deferred-prefill",
        "--C",
        "64",
        "--prompt-tokens",
        "32",
        "--mean-output",
        "40",
        "--k-values",
        "1,4,16",
        "--simulate",
        "--num-requests",
        "400",
    )
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    ks = [int(r[0]) for r in rows]
    assert {1, 4, 16} <= set(ks) and all(len(r) == 5 for r in rows)
    assert all(float(x) > 0 for r in rows for x in r[1:4])
    for label in ("K* (Prop. 1) =", "K* (renewal) =", "simulated best K =", "c_p ="):
        assert label in out


@pytest.mark.parametrize(
    "args,message",
    [
        (("--k-values", "0,3"), "must lie in 1"),
        (("--C", "1"), "need C >= 2"),
        (("--num-requests", "10", "--simulate"), "4 C"),
    ],
)
def test_analyze_refuses_bad_input_with_exit_2(capsys, args, message):
    code, _, err = medha(capsys, "analyze", "deferred-prefill", "--C", "16", *args)
    assert code == 2 and message in err


def test_analyze_help_explains_every_flag(capsys):
    for args in (["analyze", "--help"], ["analyze", "deferred-prefill", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "deferred-prefill" in out and "Proposition 1" in out
    for flag in (
        "--C",
        "--prompt-tokens",
        "--mean-output",
        "--prefill-only-iterations",
        "--k-values",
        "--simulate",
        "--num-requests",
        "--model",
        "--hardware",
    ):
        assert flag in out


# ---- the paper's setting (issue 31) ------------------------------------------------------------


def test_the_papers_models_have_its_parameter_counts():
    from medha.perf.model_specs import get_model

    # section 4.1: LLaMA 8.03B, Granite 8.17B parameters
    assert get_model("llama-3-8b").num_params / 1e9 == pytest.approx(8.03, abs=0.005)
    granite = get_model("ibm-granite/granite-3.1-8b-instruct")
    assert granite.num_params / 1e9 == pytest.approx(8.17, abs=0.005)
    assert granite.kv_bytes_per_token(2) == 40 * 2 * 8 * 128 * 2


def test_the_papers_a100_runs_at_its_fixed_clocks():
    from medha.analysis.deferred_prefill_costs import a100_pcie_paper
    from medha.perf import get_hardware

    hw, sxm = a100_pcie_paper(), get_hardware("a100")
    assert hw.peak_flops == pytest.approx(312e12 * 1380 / 1410)
    assert hw.mem_bw == pytest.approx(1.935e12) and hw.mem_bw < sxm.mem_bw
    assert hw.gemm_eff == sxm.gemm_eff


def test_vllm_cpu_line_follows_vidurs_measurements():
    from medha.analysis.deferred_prefill_costs import VIDUR_VLLM_CPU_MS, vllm_cpu_line

    fixed, per_seq = vllm_cpu_line()
    assert 0 < fixed < 5e-3 and 0 < per_seq < 1e-3
    for n, *parts in VIDUR_VLLM_CPU_MS:
        assert fixed + per_seq * n == pytest.approx(sum(parts) * 1e-3, abs=0.6e-3)


def test_vllm_cpu_predictor_adds_cpu_time_once_per_iteration():
    from medha.analysis.deferred_prefill_costs import VllmCpuPredictor, vllm_predictor

    inner = FixedCostPredictor(token_s=1e-4, iteration_s=0.0)
    p = VllmCpuPredictor(inner, fixed_s=2e-3, per_seq_s=1e-4, prefill_extra_s=5e-3)
    decodes = [100] * 10
    assert p.shape_time((), decodes) == pytest.approx(inner.shape_time((), decodes) + 3e-3)
    # a prefill iteration of two prompts: the CPU line for 2 sequences plus the extra
    prompts = [(50, 0), (50, 0)]
    assert p.shape_time(prompts) == pytest.approx(inner.shape_time(prompts) + 2.2e-3 + 5e-3)
    assert p.shape_time() == 0.0
    # the roofline inside carries no iteration overhead of its own: it is the measured one
    assert vllm_predictor("llama-3-8b").inner.hardware.iteration_overhead_s == 0.0


def test_completion_times_obey_littles_law():
    # with the batch full and refilled at once, mean completion x departures/s = mean occupancy:
    # C at K = 1, lower once K departures are waited for
    system, predictor = toy_system()
    cluster = ClusterConfig(model="llama-3-8b", hardware="h100")
    points = {
        k: simulate_point(system, k, cluster, ParallelConfig(), predictor, 3000) for k in (1, 32)
    }
    occupancy = {k: p.mean_completion_s * p.departures_per_s for k, p in points.items()}
    assert occupancy[1] == pytest.approx(system.cap, rel=0.06)
    assert 0.6 * system.cap < occupancy[32] < 0.9 * system.cap
    for p in points.values():
        assert p.mean_normalized_s <= p.p95_normalized_s
        # a request decodes at one token per step of at least 10 ms (the toy's fixed cost)
        assert p.mean_normalized_s > 0.01


def test_analyze_with_vllm_cpu_time_slows_every_k_and_refuses_other_predictors(capsys):
    args = ("analyze", "deferred-prefill", "--C", "64", "--k-values", "1,8", "--hardware", "a100")
    code, plain, err = medha(capsys, *args)
    assert code == 0, err
    code, vllm, err = medha(capsys, *args, "--vllm-cpu")
    assert code == 0, err
    assert "vLLM's CPU time per iteration" in vllm

    def renewal(out):
        return {
            int(r[0]): float(r[2])
            for r in (ln.split() for ln in out.splitlines())
            if r and r[0].isdigit()
        }

    # 0.17 ms per sequence per step on top of the GPU's time: every K is slower
    assert all(renewal(vllm)[k] < renewal(plain)[k] for k in (1, 8))
    code, _, err = medha(capsys, *args, "--vllm-cpu", "--predictor", "roofline-padded")
    assert code == 2 and "roofline predictor" in err


def test_trace_points_take_vllms_sharegpt_filter_and_match_the_synthetic_path():
    from medha.analysis.deferred_prefill_sim import (
        SHAREGPT_FILTER,
        saturated_workload,
        simulate_trace_point,
        trace_requests,
    )

    least, longest_prompt, longest_total = SHAREGPT_FILTER
    reqs = trace_requests("sharegpt", 500, seed=3)
    assert [r.prompt_len for r in reqs] == [
        r.prompt_len for r in trace_requests("sharegpt", 500, 3)
    ]
    assert all(least <= r.prompt_len <= longest_prompt for r in reqs)
    assert all(r.max_tokens >= least and r.prompt_len + r.max_tokens <= longest_total for r in reqs)
    # the same requests through both paths: the same schedule, so the same departures
    system, predictor = toy_system()
    cluster = ClusterConfig(model="llama-3-8b", hardware="h100")
    synthetic = build_requests(saturated_workload(system, 2000, 0), 1 << 20)
    a = simulate_point(system, 8, cluster, ParallelConfig(), predictor, 2000)
    b = simulate_trace_point(system.cap, 8, synthetic, cluster, ParallelConfig(), predictor)
    assert (a.departures_per_s, a.mean_group, a.mean_completion_s) == (
        b.departures_per_s,
        b.mean_group,
        b.mean_completion_s,
    )
