"""Priority classes (REALTIME > HIGH > NORMAL > LOW): queue order, preemption order, the
simulator's per-class metrics."""

import pytest
from conftest import toy_scheduler

from medha.core.batch import BatchResult
from medha.core.request import PRIORITY_CLASSES, Request
from medha.core.request import RequestState as S
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.server.protocol import PRIORITIES
from medha.sim.replay import replay
from medha.sim.runner import RunSpec, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig, parse_priority_mix


def first_token_order(sched, reqs):
    replay(sched, reqs, on_batch=lambda b, now: sched.check_invariants())
    return [r.request_id for r in sorted(reqs, key=lambda r: r.token_times_s[0])]


def test_classes_are_one_list_for_the_api_and_the_scheduler():
    assert PRIORITIES == PRIORITY_CLASSES == ("REALTIME", "HIGH", "NORMAL", "LOW")


def test_class_names_are_checked_and_any_case_is_accepted():
    assert Request("a", 0.0, 5, 1, priority_class="low").priority_class == "LOW"
    assert (
        Request("a", 0.0, 5, 1).priority_rank
        == Request("b", 0.0, 5, 1, priority_class="NORMAL").priority_rank
        == 2
    )
    with pytest.raises(ValueError, match="priority_class must be one of REALTIME"):
        Request("a", 0.0, 5, 1, priority_class="urgent")
    with pytest.raises(ValueError, match="priority_base must name another policy"):
        SchedulerConfig.from_flat(policy="priority", priority_base="priority")


def test_class_first_then_arrival():
    # one prefill per iteration: the order of first tokens is the queue order
    sched = toy_scheduler(policy="priority", chunking="static:64", multi_prefill=False)
    reqs = [
        Request("low", 0.0, 64, 1, priority_class="LOW"),
        Request("normal", 0.001, 64, 1),
        Request("high", 0.002, 64, 1, priority_class="HIGH"),
        Request("rt", 0.003, 64, 1, priority_class="REALTIME"),
        Request("high2", 0.004, 64, 1, priority_class="HIGH"),
    ]
    # "low" arrives alone and runs first; everyone else waits for the next iteration
    assert first_token_order(sched, reqs) == ["low", "rt", "high", "high2", "normal"]
    fcfs = toy_scheduler(policy="fcfs", chunking="static:64", multi_prefill=False)
    reqs = [
        Request(r.request_id, r.arrival_s, 64, 1, priority_class=r.priority_class) for r in reqs
    ]
    assert first_token_order(fcfs, reqs) == ["low", "normal", "high", "rt", "high2"]


def test_base_policy_orders_within_a_class():
    sched = toy_scheduler(
        policy="priority", priority_base="edf", chunking="static:64", multi_prefill=False
    )
    reqs = [
        Request("block", 0.0, 64, 1),
        Request("late_deadline", 0.001, 64, 1, ttft_deadline_s=5.0),
        Request("early_deadline", 0.002, 64, 1, ttft_deadline_s=1.0),
        Request("low_urgent", 0.003, 64, 1, priority_class="LOW", ttft_deadline_s=0.1),
    ]
    assert first_token_order(sched, reqs) == [
        "block",
        "early_deadline",
        "late_deadline",
        "low_urgent",
    ]


def two_decodes(policy, first_class, second_class):
    # Six 16-token blocks; two 47-token prompts fill three blocks each once they have their
    # first token. The next decode needs a fourth block: one of the two must go.
    sched = toy_scheduler(policy=policy, num_blocks=6, watermark=0.0, iteration_budget_s=0.2)
    a = Request("a", 0.0, 47, 30, priority_class=first_class)
    b = Request("b", 0.0, 47, 30, priority_class=second_class)
    for r in (a, b):
        sched.add_request(r, 0.0)
    now = 0.0
    for _ in range(3):
        batch = sched.schedule(now)
        now += batch.predicted_time_s
        sched.update(batch, BatchResult(batch.predicted_time_s), now)
        sched.check_invariants()
    return batch, a, b


def test_a_low_decode_is_evicted_before_a_high_one():
    batch, a, b = two_decodes("priority", "LOW", "HIGH")
    assert batch.preempted == [a] and [c.request for c in batch.decodes] == [b]
    # without classes the newer decode goes, whatever its class
    batch, a, b = two_decodes("fcfs", "LOW", "HIGH")
    assert batch.preempted == [b] and [c.request for c in batch.decodes] == [a]


def realtime_behind_low_decode(policy, **config):
    # 6 blocks (96 tokens). A LOW request decodes in 4 blocks; a REALTIME prompt of 40
    # tokens needs 3 and finds 2 free.
    sched = toy_scheduler(
        policy=policy, chunking="static:64", num_blocks=6, watermark=0.0, **config
    )
    low = Request("low", 0.0, 60, 30, priority_class="LOW")
    rt = Request("rt", 0.065, 40, 5, priority_class="REALTIME")  # low has ~6 tokens
    replay(sched, [low, rt], on_batch=lambda b, now: sched.check_invariants())
    assert low.state is rt.state is S.FINISHED
    assert low.num_output_tokens == 30 and rt.num_output_tokens == 5
    return sched, low, rt


def test_a_realtime_prompt_preempts_a_low_decode():
    _, low, rt = realtime_behind_low_decode("priority")
    assert low.num_preemptions == 1
    assert rt.ttft_s < 0.045  # starts at once: 40 tokens are 39 ms of work
    _, low, rt_fcfs = realtime_behind_low_decode("fcfs")
    assert low.num_preemptions == 0  # a prefill never evicts a decode outside the classes
    assert rt_fcfs.ttft_s > rt.ttft_s + 0.001


def test_a_new_prompt_of_another_class_does_not_evict_a_more_urgent_decode():
    sched = toy_scheduler(policy="priority", chunking="static:64", num_blocks=6, watermark=0.0)
    high = Request("high", 0.0, 60, 30, priority_class="HIGH")
    normal = Request("normal", 0.065, 40, 5)
    replay(sched, [high, normal])
    assert high.num_preemptions == 0 and normal.token_times_s[0] > high.token_times_s[-1]


def test_priority_mix_gives_per_class_metrics_and_keeps_the_requests():
    assert parse_priority_mix("realtime:1,LOW:3") == {"REALTIME": 0.25, "LOW": 0.75}
    with pytest.raises(ValueError, match="priority_mix"):
        parse_priority_mix("URGENT:1")
    workload = dict(
        trace="synthetic", prompt_len=256, output_len=16, qps=20.0, num_requests=60, seed=3
    )
    spec = RunSpec(
        cluster=ClusterConfig(hardware="h100"),
        parallel=ParallelConfig(),
        scheduler=SchedulerConfig(policy="priority"),
    )
    mixed = simulate(spec, WorkloadConfig(**workload, priority_mix="REALTIME:1,LOW:1"))
    plain = simulate(spec, WorkloadConfig(**workload))
    classes = mixed.summary["by_priority"]
    assert set(classes) == {"REALTIME", "LOW"}
    assert classes["REALTIME"]["count"] + classes["LOW"]["count"] == 60
    assert set(plain.summary["by_priority"]) == {"NORMAL"}
    # the same lengths and arrivals with and without classes
    assert [(m.arrival_s, m.prompt_len) for m in mixed.rows] == [
        (m.arrival_s, m.prompt_len) for m in plain.rows
    ]


# ---- SLO-risk preemption (seed 001) ----------------------------------------------------------
def _decode(name, cls, generated, last_token_s=1.0, target=None, kv=100):
    r = Request(name, 0.0, kv, 1000, priority_class=cls, tpot_target_s=target)
    r.token_times_s = [0.5, last_token_s]
    r.output_token_ids = [0] * generated
    r.num_scheduled = kv
    return r


def _slo_policy(**settings):
    from medha.scheduler.policies import make_policy

    config = SchedulerConfig.from_flat(
        policy="priority", tpot_target_s=0.05, priority_slo_risk=True, **settings
    )
    return make_policy("priority", config)


def _step(kv_lens):  # 8 ms for the weights, 6 ms per decode
    return 0.008 + 0.006 * len(kv_lens)


def test_slo_risk_sheds_low_then_normal_fewest_tokens_first_until_the_slack_is_back():
    policy = _slo_policy(priority_slo_risk_resume_s=0.020)
    high = _decode("high", "HIGH", 7)
    rt = _decode("rt", "REALTIME", 3)
    n1, n2 = _decode("n1", "NORMAL", 10), _decode("n2", "NORMAL", 2)
    l1, l2 = _decode("l1", "LOW", 50), _decode("l2", "LOW", 5)
    decodes = [n1, high, l1, rt, n2, l2]
    # six decodes: a 44 ms step leaves the protected ones 6 ms of their 50 ms target (< 15 ms).
    # Shedding l2 leaves 12 ms, then l1 18 ms, then n2 24 ms (> 20 ms): three victims.
    assert policy.slo_risk_victims(decodes, [], _step, now=1.0) == [l2, l1, n2]
    # the default resume slack (30 ms) needs a 20 ms step: every candidate goes, never a
    # protected one
    policy = _slo_policy()
    assert policy.slo_risk_victims(decodes, [], _step, now=1.0) == [l2, l1, n2, n1]


def test_slo_risk_leaves_decodes_alone_with_slack_off_or_for_a_token_already_late():
    decodes = [_decode("high", "HIGH", 1), _decode("low", "LOW", 1)]
    # a 20 ms step leaves 30 ms: nobody is at risk
    assert _slo_policy().slo_risk_victims(decodes, [], _step, now=1.0) == []
    slow = lambda kv_lens: 0.045  # noqa: E731
    assert _slo_policy().slo_risk_victims(decodes, [], slow, now=1.0) == decodes[1:]
    # off by default; and a token already past its target cannot be saved by preempting
    assert make_default_priority().slo_risk_victims(decodes, [], slow, now=1.0) == []
    assert _slo_policy().slo_risk_victims(decodes, [], slow, now=1.06) == []
    # its own TPOT target counts, not the scheduler's
    tight = [_decode("high", "HIGH", 1, target=0.03), _decode("low", "LOW", 1)]
    assert _slo_policy().slo_risk_victims(tight, [], _step, now=1.0) == tight[1:]


def make_default_priority():
    from medha.scheduler.policies import make_policy

    return make_policy("priority", SchedulerConfig.from_flat(policy="priority"))


def test_slo_risk_keeps_shed_requests_out_until_they_fit_again():
    policy = _slo_policy(priority_slo_risk_resume_s=0.020)
    high = _decode("high", "HIGH", 1)
    lows = [_decode(f"l{i}", "LOW", i) for i in range(4)]
    victims = policy.slo_risk_victims([high, *lows], [], _step, now=1.0)
    assert victims == lows[:2]  # 38 -> 26 ms: 24 ms of slack
    # in the batch that sheds, nothing comes back and new NORMAL/LOW prompts wait
    assert policy.swap_in_order(list(victims), None) == []
    fresh, high_new = Request("new", 0.9, 10, 1), Request("hn", 0.9, 10, 1, priority_class="HIGH")
    assert policy.admit([fresh, high_new], lambda _: True, 1.0) == [high_new]
    # next batch: with the two left running, one more would leave 18 ms (< 20 ms): none comes
    # back; with one of them finished, one does
    assert policy.slo_risk_victims([high, *lows[2:]], victims, _step, now=1.0) == []
    assert policy.swap_in_order(list(victims), None) == []
    assert policy.slo_risk_victims([high, lows[2]], victims, _step, now=1.0) == []
    assert policy.swap_in_order(list(victims), None) == [victims[0]]
    assert policy.admit([fresh], lambda _: True, 1.0) == []  # one shed still out
    # with no protected decode left, the verdict goes
    assert policy.slo_risk_victims([lows[2]], victims, _step, now=1.0) == []
    assert policy.swap_in_order(list(victims), None) == victims
    assert policy.admit([fresh], lambda _: True, 1.0) == [fresh]


def test_slo_risk_settings_are_checked():
    with pytest.raises(ValueError, match="priority_slo_risk_resume_s"):
        SchedulerConfig.from_flat(priority_slo_risk_slack_s=0.03, priority_slo_risk_resume_s=0.02)
    with pytest.raises(ValueError, match="priority_slo_risk_slack_s must be"):
        SchedulerConfig.from_flat(priority_slo_risk_slack_s=-1.0)
    with pytest.raises(ValueError, match="priority_slo_risk_resume_s must be"):
        SchedulerConfig.from_flat(priority_slo_risk_resume_s=float("nan"))


def test_slo_risk_preemption_in_the_simulator_finishes_everyone_and_preempts_more():
    workload = WorkloadConfig(
        trace="synthetic",
        prompt_len=16000,
        output_len=1000,
        output_distribution="geometric",
        qps=0.5,
        num_requests=60,
        seed=0,
        priority_mix="REALTIME:0.1,HIGH:0.2,NORMAL:0.4,LOW:0.3",
    )
    out = {}
    for on in (False, True):
        spec = RunSpec(
            cluster=ClusterConfig(hardware="a100"),
            parallel=ParallelConfig(),
            scheduler=SchedulerConfig.from_flat(
                policy="priority", preemption_mode="swap", priority_slo_risk=on
            ),
        )
        outcome = simulate(spec, workload)
        assert all(r.finish_s is not None for r in outcome.result.requests)
        out[on] = outcome.summary["preemption"]["preemptions"]
    assert out[True] > out[False]
