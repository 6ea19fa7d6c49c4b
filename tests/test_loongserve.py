"""The LoongServe baseline: the ring-attention (context-parallel) prefill model, the
elastic-instance simulator's scheduling (convoy, decode stalls, reserved pool, multi-master
decoding) and `medha simulate --system loongserve`."""

import dataclasses
import json
import subprocess
import sys

import pytest

from medha.core.request import Request
from medha.perf import ParallelConfig, make_predictor
from medha.perf.ring_attention import context_parallel_prefill_time, ring_prefill_time
from medha.scheduler.config import SchedulerConfig
from medha.sim.baselines.loongserve import LoongServeSimulator
from medha.sim.config import ClusterConfig, LoongServeSettings
from medha.sim.runner import RunSpec, simulate
from medha.sim.workload.generator import WorkloadConfig

# ---- the ring model -------------------------------------------------------------------------


def tp_predictor(hardware="a100", tp=2):
    return make_predictor("roofline", "llama-3-8b", hardware, ParallelConfig(tp=tp))


@pytest.mark.parametrize("lens", [[512], [100_000], [300, 2000, 5000]])
def test_degree_one_is_the_predictors_own_prefill(lens):
    p = tp_predictor()
    t = ring_prefill_time(p, lens, 1, inter_node=False)
    assert t.total_s == pytest.approx(p.shape_time([(n, 0) for n in lens]), rel=1e-12)
    assert t.transfer_s == 0 and t.exposed_transfer_s == 0


def test_more_instances_speed_up_a_long_prompt_with_the_transfer_hidden():
    p = tp_predictor()
    times = [ring_prefill_time(p, 131_072, d, inter_node=False) for d in (1, 2, 4, 8)]
    for a, b in zip(times, times[1:]):
        assert b.total_s < 0.6 * a.total_s  # close to halving each time
    # a long slice computes longer than its KV takes to move: the ring hides the transfer
    assert all(t.transfer_s > 0 and t.exposed_transfer_s == 0 for t in times[1:])
    # attention: (d - 1) steps of max(block, transfer) plus the last block, and one launch each
    t = times[2]
    launches = 3 * p.model.num_layers * p.hardware.kernel_overhead_s
    assert t.attention_s == pytest.approx(4 * t.block_s + launches)


def test_the_plain_ring_waits_for_its_unmasked_blocks():
    p = tp_predictor("h100", tp=8)
    one = ring_prefill_time(p, 500_000, 1, inter_node=True, striped=False)
    assert one.total_s == ring_prefill_time(p, 500_000, 1, inter_node=True).total_s
    striped = ring_prefill_time(p, 500_000, 4, inter_node=True)
    plain = ring_prefill_time(p, 500_000, 4, inter_node=True, striped=False)
    # three unmasked steps (each two causal blocks) and a causal one, against four causal
    launches = 3 * p.model.num_layers * p.hardware.kernel_overhead_s
    assert (plain.attention_s - launches) / (striped.attention_s - launches) == pytest.approx(
        7 / 4, rel=0.01
    )


def test_a_ring_across_nodes_is_slower_when_the_transfer_shows():
    p = tp_predictor("h100", tp=8)
    intra = ring_prefill_time(p, 16_384, 8, inter_node=False)
    inter = ring_prefill_time(p, 16_384, 8, inter_node=True)
    assert inter.transfer_s > 5 * intra.transfer_s  # 40 GB/s against 400 GB/s
    assert inter.exposed_transfer_s > 0
    assert inter.total_s > intra.total_s
    # short slices: the transfer, not the compute, sets the step, so degree stops paying
    small = [ring_prefill_time(p, 16_384, d, inter_node=True).total_s for d in (4, 8, 16)]
    assert small[2] > 0.75 * small[1]


def test_context_parallel_places_groups_node_by_node():
    p8 = tp_predictor("h100", tp=8)
    assert not context_parallel_prefill_time(p8, 10_000, 1).inter_node
    assert context_parallel_prefill_time(p8, 10_000, 2).inter_node
    p2 = tp_predictor("h100", tp=2)
    assert not context_parallel_prefill_time(p2, 10_000, 4).inter_node
    assert context_parallel_prefill_time(p2, 10_000, 5).inter_node
    with pytest.raises(ValueError, match="degree"):
        ring_prefill_time(p8, 100, 0, False)
    with pytest.raises(ValueError, match="positive"):
        ring_prefill_time(p8, [100, 0], 2, False)


# ---- the simulator --------------------------------------------------------------------------


def loong(instances=8, max_degree=4, tp=2, kv_memory_gb=None, **settings):
    cluster = ClusterConfig(
        system="loongserve",
        kv_memory_gb=kv_memory_gb,
        loong=LoongServeSettings(instances=instances, max_degree=max_degree, **settings),
    )
    return LoongServeSimulator(cluster, ParallelConfig(tp=tp), SchedulerConfig(), check=True)


def ring_s(sim, n, d, inter=False):
    return ring_prefill_time(sim.predictor, n, d, inter).total_s


def test_the_ring_setting_prices_loongserves_prefills_as_that_ring():
    """--loong-ring contiguous: the planner's prefill times are the plain ring's (slower than
    the striped one at degree 4 on a long prompt), and degree 1 is the same either way."""
    striped, plain = loong(), loong(ring="contiguous")
    n = 200_000
    assert plain._ring((n,), 4, False) == ring_prefill_time(plain.predictor, n, 4, False, False)
    assert plain._ring((n,), 4, False).total_s > striped._ring((n,), 4, False).total_s
    assert plain._ring((n,), 1, False) == striped._ring((n,), 1, False)
    with pytest.raises(ValueError, match="loong_ring"):
        LoongServeSettings(ring="zigzag")


def test_every_request_finishes_and_the_run_is_deterministic():
    work = WorkloadConfig(trace="sharegpt", qps=1.0, num_requests=60, long_fraction=0.05, seed=4)
    spec = RunSpec(
        cluster=ClusterConfig(system="loongserve"),
        parallel=ParallelConfig(tp=2),
    )
    a, b = simulate(spec, work), simulate(spec, work)
    assert a.summary["requests"]["completed"] == 60
    assert a.summary["by_class"]["long"]["count"] >= 1
    assert [r.token_times_s for r in a.result.requests] == [
        r.token_times_s for r in b.result.requests
    ]
    assert all(r.num_output_tokens == r.max_tokens for r in a.result.requests)
    assert a.result.num_devices == 16
    # each instance's iterations never overlap
    log = a.result.log
    for inst in range(8):
        spans = sorted((s, e) for i, s, e in zip(log.replica, log.start_s, log.end_s) if i == inst)
        assert all(e0 <= s1 + 1e-12 for (_, e0), (s1, _) in zip(spans, spans[1:]))


def test_a_long_prefill_blocks_shorts_only_when_no_instance_is_free():
    def run(instances):
        sim = loong(instances=instances, max_degree=2)
        long_ = Request("long", 0.0, 200_000, 2)
        short = Request("short", 1.0, 500, 2)
        sim.run([long_, short])
        return long_, short, sim

    long_, short, sim = run(2)  # the long prefill takes both instances
    t_long = ring_s(sim, 200_000, 2)
    assert long_.ttft_s == pytest.approx(t_long)
    assert short.ttft_s > t_long - 1.0  # waited for the whole long prefill: the convoy
    long_, short, sim = run(4)  # two instances stay free
    assert long_.ttft_s == pytest.approx(t_long)
    assert short.ttft_s < 0.1


def test_fcfs_a_short_behind_a_waiting_long_waits_too():
    # one instance: the first long runs, the second long is the head, the short queues behind
    sim = loong(instances=1, max_degree=1)
    a, b = Request("a", 0.0, 50_000, 1), Request("b", 0.1, 50_000, 1)
    s = Request("s", 0.2, 100, 1)
    sim.run([a, b, s])
    assert s.first_token_s > b.first_token_s > a.first_token_s


def test_backfill_lets_a_short_pass_a_waiting_long_without_delaying_it():
    # 3 instances: long "a" takes 2 (max degree 2); longer "b" finishes soonest on 2 and waits
    # for "a"'s rather than start alone on the third; the short behind it waits (FCFS) or
    # starts on the third (backfill), and "b" starts when it would have
    def run(backfill):
        sim = loong(instances=3, max_degree=2, backfill=backfill)
        a, b = Request("a", 0.0, 200_000, 1), Request("b", 0.1, 400_000, 1)
        s = Request("s", 0.2, 100, 1)
        sim.run([a, b, s])
        return a, b, s

    a, b, s = run(False)
    assert s.first_token_s >= a.first_token_s  # it waited until "b" left the head
    a2, b2, s2 = run(True)
    assert s2.ttft_s < 0.5
    assert (a2.first_token_s, b2.first_token_s) == (a.first_token_s, b.first_token_s)


def test_macro_iterations_start_prefills_only_every_n_decode_iterations():
    # one instance decodes "d"; "s" arrives on another, free instance. Without macro
    # iterations it starts at once; with them, only after 10 decode iterations of "d" since
    # "d"'s own prefill began, and a prefill arriving during another's runs only if it ends
    # before it (the released server's greedy fill).
    def run(every):
        sim = loong(instances=4, max_degree=1, prefill_every=every)
        d = Request("d", 0.0, 100, 400)
        s = Request("s", 0.03, 100, 1)
        sim.run([d, s])
        return d, s

    d, s = run(0)
    assert s.ttft_s < 0.05
    d, s = run(10)
    # "d"'s iterations since its prefill ended (none ran during it): s's prefill starts at
    # the 10th's end, its TTFT one prefill later
    tenth = d.token_times_s[10]
    assert d.token_times_s[1] < s.arrival_s < tenth
    assert s.first_token_s == pytest.approx(tenth + ring_s(loong(), 100, 1), rel=1e-9)
    assert s.first_token_s > d.token_times_s[9]

    # inside a macro iteration: a long prefill runs; a short arriving during it starts on a
    # free instance since it ends first, a second long does not
    def inside(every):
        sim = loong(instances=4, max_degree=1, prefill_every=every)
        big = Request("big", 0.0, 60_000, 1)
        s = Request("s", 0.5, 100, 1)
        big2 = Request("big2", 0.6, 60_000, 1)
        sim.run([big, s, big2])
        return big, s, big2

    big, s, big2 = inside(10)
    assert s.ttft_s < 0.05
    assert big2.first_token_s > big.first_token_s  # waited for the macro iteration's end
    _, _, big2_free = inside(0)
    assert big2_free.ttft_s < big2.ttft_s


def test_decodes_stall_on_an_instance_taken_by_a_prefill():
    def run(instances):
        sim = loong(instances=instances, max_degree=1)
        d = Request("decoding", 0.0, 100, 400)
        big = Request("big", 0.5, 60_000, 1)
        sim.run([d, big])
        gaps = [b - a for a, b in zip(d.token_times_s, d.token_times_s[1:])]
        return max(gaps), ring_s(sim, 60_000, 1)

    gap, t_big = run(1)  # the only instance prefills "big": "decoding" gets no token meanwhile
    assert gap >= t_big * 0.99
    gap, _ = run(2)  # "big" takes the instance that holds no decodes
    assert gap < 0.1


def test_the_reserved_pool_serves_shorts_while_longs_hold_the_rest():
    def run(reserved):
        sim = loong(instances=4, max_degree=4, reserved_short=reserved)
        long_ = Request("long", 0.0, 150_000, 2)
        shorts = [Request(f"s{i}", 1.0 + 0.5 * i, 300, 4) for i in range(5)]
        result = sim.run([long_, *shorts])
        return long_, shorts, result

    long_, shorts, result = run(0)  # the long prefill takes all four instances
    t_long = ring_s(loong(instances=4), 150_000, 4)
    assert long_.ttft_s == pytest.approx(t_long)
    assert all(s.first_token_s > t_long for s in shorts)  # each waited for it
    long2, shorts, result = run(1)
    assert max(s.ttft_s for s in shorts) < 0.1
    # the short pool's instance (the last) never ran the long prefill, which now has three
    log = result.log
    long_rows = [log.chunk_iteration[i] for i, r in enumerate(log.chunk_request) if r == "long"]
    long_iter_start = log.start_s[long_rows[0]]
    busy = {
        inst
        for inst, s, lat in zip(log.replica, log.start_s, log.latency_s)
        if s == long_iter_start and lat > 1.0
    }
    assert busy == {0, 1, 2}
    assert long2.ttft_s > long_.ttft_s


def test_a_request_larger_than_one_instance_decodes_over_several():
    # 1 GiB of KV per device on TP2: 16,384 tokens per instance
    sim = loong(instances=4, max_degree=2, kv_memory_gb=1.0)
    assert sim.capacity == 16_384
    r = Request("big", 0.0, 20_000, 8)
    small = Request("small", 0.0, 200, 8)
    result = sim.run([r, small])
    assert r.num_output_tokens == 8 and small.num_output_tokens == 8
    # its decode iterations run on two instances at the same times
    log = result.log
    decode_rows = [i for i, n in enumerate(log.num_decodes) if n and log.decode_kv[i] >= 20_000]
    starts = {log.start_s[i] for i in decode_rows}
    assert len(starts) == 7  # 8 output tokens: the prefill's and 7 decode iterations
    for s in starts:
        assert len({log.replica[i] for i, t in enumerate(log.start_s) if t == s}) >= 2
    with pytest.raises(ValueError, match="exceeds the KV capacity of 2 instances"):
        loong(instances=4, max_degree=2, kv_memory_gb=1.0).run([Request("x", 0.0, 33_000, 1)])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="loong_reserved_short"):
        LoongServeSettings(instances=2, reserved_short=2)
    with pytest.raises(ValueError, match="loong_max_degree"):
        LoongServeSettings(max_degree=0)
    with pytest.raises(ValueError, match="loong_degree_tolerance"):
        LoongServeSettings(degree_tolerance=-0.1)
    with pytest.raises(ValueError, match="replicas does not apply"):
        ClusterConfig(system="loongserve", replicas=2)
    with pytest.raises(ValueError, match="unknown system"):
        ClusterConfig(system="vllm")
    with pytest.raises(ValueError, match="spp and kvp must be 1"):
        LoongServeSimulator(
            ClusterConfig(system="loongserve"), ParallelConfig(tp=2, spp=2), SchedulerConfig()
        )
    cfg = ClusterConfig.from_flat(system="loongserve", loong_instances=4, loong_max_degree=2)
    assert dataclasses.asdict(cfg.loong)["instances"] == 4


def test_medha_runs_echo_no_baseline_settings():
    spec = RunSpec(cluster=ClusterConfig())
    assert not any(k == "system" or k.startswith("loong_") for k in spec.to_json()["cluster"])
    spec = RunSpec(cluster=ClusterConfig(system="loongserve"))
    assert spec.to_json()["cluster"]["loong_max_degree"] == 4


# ---- the CLI --------------------------------------------------------------------------------


def medha(*args):
    return subprocess.run([sys.executable, "-m", "medha", *args], capture_output=True, text=True)


def test_cli_compares_loongserve_with_medha(tmp_path):
    out = tmp_path / "cmp"
    res = medha(
        "simulate",
        "--qps", "1", "--num-requests", "30", "--long-fraction", "0.05", "--seed", "1",
        "--tp", "2",
        "--compare",
        "name=loong,system=loongserve",
        "name=reserv,system=loongserve,loong_reserved_short=2",
        "name=medha,tp=8,spp=2",
        "--out", str(out), "--quiet", "--no-plots",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for name in ("loong", "reserv", "medha"):
        assert f"| {name} |" in res.stdout
    s = json.loads((out / "reserv" / "summary.json").read_text())
    assert s["config"]["cluster"]["system"] == "loongserve"
    assert s["config"]["cluster"]["loong_reserved_short"] == 2
    assert s["requests"]["completed"] == 30
    bad = medha(
        "simulate", "--system", "loongserve", "--loong-max-degree", "0", "--qps", "1",
        "--num-requests", "5", "--out", str(tmp_path / "never"), "--quiet",
    )  # fmt: skip
    assert bad.returncode == 2 and "loong_max_degree must be a positive integer" in bad.stderr
    assert "Traceback" not in bad.stderr
    help_text = medha("simulate", "--help").stdout
    assert "--loong-reserved-short" in help_text and "--system" in help_text
