"""Priority classes (REALTIME > HIGH > NORMAL > LOW): queue order, preemption order, the
simulator's per-class metrics."""

import pytest
from conftest import toy_scheduler

from medha.core.batch import BatchResult
from medha.core.config import SchedulerConfig
from medha.core.request import PRIORITY_CLASSES, Request
from medha.core.request import RequestState as S
from medha.perf import ParallelConfig
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
