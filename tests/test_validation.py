"""Bad input raises ValueError naming the field, and leaves the scheduler as it was."""

import dataclasses

import pytest
from conftest import toy_scheduler

from medha.core.batch import BatchResult
from medha.core.request import Request
from medha.perf.model_specs import ModelSpec
from medha.perf.toy_predictor import FixedCostPredictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import ReplicaScheduler


def snapshot(sched):
    return (
        len(sched),
        sched.prefill_counts(),
        sched.num_decoding,
        sched.blocks.num_free,
        dataclasses.astuple(sched.stats),
        [r.admission_seq for r in sched.live_requests()],
        sorted(sched.blocks.owners()),
    )


@pytest.fixture
def busy_scheduler():
    sched = toy_scheduler(max_model_len=4096, num_blocks=512)
    for i in range(3):
        sched.add_request(Request(f"ok{i}", 0.0, 100, 10), 0.0)
    batch = sched.schedule(0.0)
    sched.update(batch, BatchResult(0.05), 0.05)
    return sched


def corrupt(field, value):
    r = Request("bad", 0.1, 50, 5)
    object.__setattr__(r, field, value)  # slip past the constructor's own check
    return r


@pytest.mark.parametrize(
    "request_, field",
    [
        (corrupt("max_tokens", 0), "max_tokens"),
        (corrupt("max_tokens", -4), "max_tokens"),
        (corrupt("prompt_len", 0), "prompt"),
        (corrupt("ttft_deadline_s", 0.0), "ttft_deadline_s"),
        (corrupt("ttft_deadline_s", -2.0), "ttft_deadline_s"),
        (corrupt("tpot_target_s", -1.0), "tpot_target_s"),
        (Request("bad", 0.1, 5000, 5), "max_model_len"),  # prompt longer than the context
        (Request("bad", 0.1, 4000, 500), "max_tokens"),  # prompt fits, the completion does not
        (Request("ok0", 0.1, 10, 5), "request_id"),  # duplicate
    ],
)
def test_bad_requests(busy_scheduler, request_, field):
    before = snapshot(busy_scheduler)
    with pytest.raises(ValueError, match=field):
        busy_scheduler.add_request(request_, 0.1)
    assert snapshot(busy_scheduler) == before
    busy_scheduler.check_invariants()
    assert request_.deadline_s == float("inf") or request_.request_id == "ok0"


def test_more_than_the_kv_cache_can_ever_hold():
    sched = toy_scheduler(num_blocks=4)  # 64 tokens
    before = snapshot(sched)
    with pytest.raises(ValueError, match="KV cache capacity"):
        sched.add_request(Request("big", 0.0, 60, 10), 0.0)
    assert snapshot(sched) == before


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(policy="fifo"), "policy"),
        (dict(chunking="static:abc"), "chunking"),
        (dict(chunking="chunky"), "chunking"),
        (dict(tpot_target_s=0), "tpot_target_s"),
        (dict(ttft_deadline_s=-1.0), "ttft_deadline_s"),
        (dict(iteration_budget_s=0.0), "iteration_budget_s"),
        (dict(rho_max=1.5), "rho_max"),
        (dict(lars_slack="left"), "lars_slack"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(long_prefill_threshold=-5), "long_prefill_threshold"),
    ],
)
def test_bad_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig.from_flat(**kwargs)  # (flat names, as flags and YAML give them)


def test_context_limit_comes_from_the_model():
    tiny = ModelSpec("tiny", 1, 8, 1, 1, 8, 16, 32, max_context=128)
    sched = ReplicaScheduler(
        SchedulerConfig(), FixedCostPredictor(1e-3, model=tiny), BlockManager(64)
    )
    assert sched.max_model_len == 128  # from the model spec
    with pytest.raises(ValueError, match="max_model_len=128"):
        sched.add_request(Request("r", 0.0, 129, 1), 0.0)
