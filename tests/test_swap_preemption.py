"""Swap preemption: KV moved to a host pool and back instead of recomputed; the choice by cost;
the pool's capacity. The engine's real copies are in test_swap_engine.py."""

import pytest
from conftest import TOKEN_S, toy_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from medha.core.batch import BatchResult
from medha.core.request import PRIORITY_CLASSES, Request
from medha.core.request import RequestState as S
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.replay import replay
from medha.sim.runner import RunSpec, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

TOY_BLOCK_BYTES = 256 * 16  # the toy model's KV: 256 bytes a token in 16-token blocks
TOY_LINK = 0.5e11  # half the toy hardware's copy bandwidth


def step(sched, now):
    batch = sched.schedule(now)
    end = now + batch.predicted_time_s
    sched.update(batch, BatchResult(batch.predicted_time_s), end)
    sched.check_invariants()
    return batch, end


def two_decodes(**config):
    """Six 16-token blocks; two 47-token prompts hold three blocks each once they have their
    first token; at the third iteration the older decode needs a fourth block and evicts the
    newer one. Returns that batch, both requests and the time."""
    sched = toy_scheduler(num_blocks=6, watermark=0.0, iteration_budget_s=0.2, **config)
    a, b = Request("a", 0.0, 47, 30), Request("b", 0.0, 47, 30)
    for r in (a, b):
        sched.add_request(r, 0.0)
    _, now = step(sched, 0.0)
    _, now = step(sched, now)
    batch, now = step(sched, now)
    return sched, batch, a, b, now


def test_a_swapped_request_resumes_without_recomputing():
    sched, batch, a, b, now = two_decodes(preemption_mode="swap", host_kv_blocks=8)
    assert [s.request for s in batch.swap_out] == [b] and not batch.preempted
    out = batch.swap_out[0]
    assert out.device_blocks == [3, 4, 5] and out.host_blocks == [0, 1, 2]
    assert b.state is S.SWAPPED and b.num_computed == b.num_scheduled == 48  # progress kept
    assert sched.kv.swap_pool.num_free == 5 and not sched.blocks.blocks_of("b")
    # the swap's time is in the batch's: three blocks out over the host link
    assert batch.swap_time_s == pytest.approx(3 * TOY_BLOCK_BYTES / TOY_LINK)
    assert batch.predicted_time_s == pytest.approx(TOKEN_S + batch.swap_time_s)
    chunks, swaps_in = [], []

    def seen(bt, t):
        chunks.extend((c.start, c.num_tokens) for c in bt.chunks if c.request is b)
        swaps_in.extend(s for s in bt.swap_in if s.request is b)

    replay(sched, [], on_batch=seen)
    assert len(swaps_in) == 1 and swaps_in[0].host_blocks == [0, 1, 2]
    # it came back into a's freed blocks and went on decoding from token 48: no re-prefill
    assert chunks[0] == (48, 1) and all(n == 1 for _, n in chunks)
    assert a.num_output_tokens == b.num_output_tokens == 30
    assert b.num_preemptions == b.num_swaps == 1
    st = sched.stats
    assert (st.swap_outs, st.swap_ins, st.recomputes, st.recomputed_tokens) == (1, 1, 0, 0)
    assert sched.blocks.num_used == 0 and sched.kv.swap_pool.num_free == 8


def test_auto_swaps_when_recomputing_is_dearer_and_recomputes_otherwise():
    # recomputing 48 tokens: 47 ms on the toy predictor; swapping 3 blocks out and back:
    # 0.5 us over the default link, 0.25 s over a 0.1 MB/s one
    _, batch, _, b, _ = two_decodes(preemption_mode="auto", host_kv_blocks=8)
    assert [s.request for s in batch.swap_out] == [b] and not batch.preempted
    _, batch, _, b, _ = two_decodes(
        preemption_mode="auto", host_kv_blocks=8, swap_bandwidth_gbps=1e-4
    )
    assert batch.preempted == [b] and not batch.swap_out and b.num_computed == 0
    # swap mode ignores the cost; both swapping modes recompute when the pool is full
    _, batch, _, b, _ = two_decodes(
        preemption_mode="swap", host_kv_blocks=8, swap_bandwidth_gbps=1e-4
    )
    assert [s.request for s in batch.swap_out] == [b]
    sched, batch, _, b, _ = two_decodes(preemption_mode="swap", host_kv_blocks=2)
    assert batch.preempted == [b] and sched.stats.recomputed_tokens == 48


def test_the_host_pool_never_holds_more_than_its_capacity():
    # twelve requests of 70-105 tokens in 40 blocks, with a 6-block pool: it fills up, and
    # then a preemption recomputes
    sched = toy_scheduler(num_blocks=40, preemption_mode="swap", host_kv_blocks=6)
    reqs = [Request(f"r{i}", 0.01 * i, 40 + 2 * i, 30 + 3 * i) for i in range(12)]
    most = []

    def check(bt, t):
        sched.check_invariants()
        most.append(sched.kv.swap_pool.num_blocks - sched.kv.swap_pool.num_free)

    replay(sched, reqs, on_batch=check)
    st = sched.stats
    assert st.swap_outs > 0 and st.recomputes > 0 and st.swap_outs == st.swap_ins
    assert max(most) == 6
    assert all(r.state is S.FINISHED and r.num_output_tokens == r.max_tokens for r in reqs)


def test_aborting_a_swapped_request_frees_its_host_blocks():
    sched, _, a, b, now = two_decodes(preemption_mode="swap", host_kv_blocks=8)
    assert sched.abort("b", now) is b and b.state is S.ABORTED
    assert sched.kv.swap_pool.num_free == 8 and sched.num_swapped == 0
    sched.check_invariants()
    replay(sched, [])
    assert a.state is S.FINISHED and sched.blocks.num_used == 0


def test_the_invariant_check_covers_the_host_pool():
    from medha.scheduler.block_manager import BlockAccountingError

    sched, _, a, b, _ = two_decodes(preemption_mode="swap", host_kv_blocks=8)
    sched.kv.swap_pool.blocks.grow("a", 16)  # a runs on the device: host blocks would leak
    with pytest.raises(BlockAccountingError, match="host blocks of a outlived its swap"):
        sched.check_invariants()
    sched.kv.swap_pool.free("a")
    sched.blocks.grow("b", 16)  # b is swapped out: it may not own device blocks too
    with pytest.raises(AssertionError, match="'b', swapped.*holds 16"):
        sched.check_invariants()


def test_swapping_is_refused_where_it_is_not_built():
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute"):
        SchedulerConfig(preemption_mode="offload")
    with pytest.raises(ValueError, match="kvp > 1"):
        from medha.sim.simulator import Simulator

        Simulator(
            ClusterConfig(hardware="h100"),
            ParallelConfig(kvp=2),
            SchedulerConfig(preemption_mode="swap"),
        )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1),
            st.integers(1, 300),
            st.integers(1, 120),
            st.sampled_from(PRIORITY_CLASSES),
        ),
        min_size=2,
        max_size=20,
    ),
    st.sampled_from(["fcfs", "lars", "priority"]),
    st.sampled_from(["adaptive", "static:64"]),
    st.integers(24, 60),
    st.sampled_from(["swap", "auto"]),
    st.integers(1, 30),
    st.lists(st.integers(0, 400), max_size=6),
)
def test_under_heavy_pressure_every_request_ends_and_nothing_leaks(
    specs, policy, chunking, blocks, mode, host_blocks, abort_steps
):
    """Small caches, long outputs and aborts at arbitrary iterations (swapped requests too)."""
    sched = toy_scheduler(
        policy=policy,
        chunking=chunking,
        num_blocks=blocks,
        preemption_mode=mode,
        host_kv_blocks=host_blocks,
        swap_bandwidth_gbps=0.0005 if mode == "auto" else None,
    )
    reqs = [
        Request(f"r{i}", t, p, o, priority_class=c)
        for i, (t, p, o, c) in enumerate(specs)
        if p + o <= blocks * 16
    ]
    pending, now, aborts = sorted(reqs, key=lambda r: r.arrival_s), 0.0, set(abort_steps)
    for it in range(100_000):
        while pending and pending[0].arrival_s <= now:
            sched.add_request(pending.pop(0), now)
        if it in aborts and sched.has_unfinished():
            victim = sorted(sched.live_requests(), key=lambda r: r.request_id)[it % len(sched)]
            sched.abort(victim.request_id, now)
        batch = sched.schedule(now)
        if batch is None:
            if not pending:
                break
            now = pending[0].arrival_s
            continue
        now += batch.predicted_time_s
        sched.update(batch, BatchResult(batch.predicted_time_s), now)
        sched.check_invariants()
    assert not sched.has_unfinished() and all(r.state.is_done for r in reqs)
    assert sched.blocks.num_used == 0 and sched.kv.swap_pool.num_free == host_blocks
    assert sched.stats.swap_ins <= sched.stats.swap_outs


def test_the_simulator_reports_swaps_beside_recomputes():
    spec = dict(
        cluster=ClusterConfig(hardware="a100", kv_memory_gb=0.25), parallel=ParallelConfig()
    )
    workload = WorkloadConfig(
        trace="synthetic", prompt_len=600, output_len=300, qps=50.0, num_requests=16
    )
    runs = {
        mode: simulate(
            RunSpec(scheduler=SchedulerConfig(preemption_mode=mode), **spec), workload
        ).summary
        for mode in ("recompute", "swap")
    }
    rec, swap = runs["recompute"]["preemption"], runs["swap"]["preemption"]
    assert rec["recomputes"] > 0 and rec["recomputed_tokens"] > 0 and rec["swap_outs"] == 0
    assert swap["swap_outs"] > 0 and swap["recomputed_tokens"] == 0
    assert swap["swapped_out_bytes_per_device"] == swap["swapped_out_blocks"] * 16 * 131072
    assert swap["swap_time_s"] > 0
    for s in runs.values():
        assert s["requests"]["completed"] == 16
