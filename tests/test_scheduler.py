import random

import pytest
from conftest import toy_scheduler
from hypothesis import example, given, settings
from hypothesis import strategies as st

from medha.core.batch import BatchResult
from medha.core.config import default_long_threshold
from medha.core.request import PRIORITY_CLASSES, Request
from medha.core.request import RequestState as S
from medha.scheduler.block_manager import BlockManager, KvpBlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.sim.replay import replay


def step(sched, now, result=None):
    batch = sched.schedule(now)
    assert batch is not None
    end = now + batch.predicted_time_s
    finished = sched.update(batch, result or BatchResult(batch.predicted_time_s), end)
    sched.check_invariants()
    return batch, end, finished


def test_life_cycle_of_one_request():
    sched = toy_scheduler()
    r = Request("a", 0.0, 100, 3)
    sched.add_request(r, 0.0)
    assert r.state is S.WAITING
    batch, now, _ = step(sched, 0.0)
    assert r.state is S.PREFILLING and batch.prefills[0].num_tokens == 64  # 1/16 s of tokens
    batch, now, _ = step(sched, now)
    assert r.state is S.DECODING and r.num_output_tokens == 1 and r.num_computed == 100
    assert r.ttft_s == pytest.approx(now)
    batch, now, _ = step(sched, now)
    assert batch.decodes[0].start == 100 and r.num_output_tokens == 2
    batch, now, finished = step(sched, now)
    assert finished == [r] and r.state is S.FINISHED and r.finish_reason == "length"
    assert len(r.token_times_s) == 3 and sched.blocks.num_used == 0
    assert sched.schedule(now) is None


def test_an_executor_revises_a_chunk_to_what_it_ran():
    """vLLM's engine may start a prompt after its prefix-cache hit, or not run a chunk at all:
    the batch is revised before it runs and the request goes on from what actually ran."""
    sched = toy_scheduler()
    r = Request("a", 0.0, 200, 2)
    sched.add_request(r, 0.0)
    batch = sched.schedule(0.0)
    chunk = batch.prefills[0]
    assert (chunk.start, chunk.num_tokens) == (0, 64)
    sched.revise(batch, chunk, 0, 0)  # not run: the batch is empty, nothing advanced
    assert batch.prefills == [] and r.num_scheduled == 0 and r.num_inflight_batches == 0
    sched.update(batch, BatchResult(0.0), 0.0)
    sched.check_invariants()
    batch = sched.schedule(0.0)
    chunk = batch.prefills[0]
    sched.revise(batch, chunk, 160, 40)  # 160 tokens cached: it ran [160:200] and sampled
    assert chunk.samples and r.num_computed == 160 and r.num_scheduled == 200
    sched.check_invariants()
    sched.update(batch, BatchResult(0.1), 0.1)
    sched.check_invariants()
    assert r.state is S.DECODING and r.num_output_tokens == 1 and r.num_computed == 200
    with pytest.raises(ValueError, match="cannot revise"):
        sched.revise(batch, chunk, 190, 40)  # past the end of its context


def test_engine_tokens_and_early_stop():
    sched = toy_scheduler()
    r = Request("a", 0.0, 10, 50)
    sched.add_request(r, 0.0)
    _, now, _ = step(sched, 0.0, BatchResult(0.01, token_ids={"a": 7}))
    _, now, finished = step(
        sched, now, BatchResult(0.01, token_ids={"a": 9}, stopped=frozenset({"a"}))
    )
    assert r.output_token_ids == [7, 9] and finished == [r] and r.finish_reason == "stop"
    assert sched.blocks.num_used == 0


def test_missing_token_is_an_error():
    sched = toy_scheduler()
    sched.add_request(Request("a", 0.0, 10, 5), 0.0)
    batch = sched.schedule(0.0)
    with pytest.raises(ValueError, match="no token for a"):
        sched.update(batch, BatchResult(0.01, token_ids={}), 0.01)


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "in_flight"])
def test_abort_frees_kv(when):
    sched = toy_scheduler()
    r = Request("a", 0.0, 200, 20)
    sched.add_request(r, 0.0)
    now = 0.0
    if when in ("prefilling", "decoding"):
        _, now, _ = step(sched, now)
    if when == "decoding":
        while r.state is not S.DECODING:
            _, now, _ = step(sched, now)
    if when == "in_flight":
        batch = sched.schedule(now)
        assert sched.abort("a", now) is r
        assert sched.blocks.num_used > 0  # the running batch still writes these blocks
        sched.update(batch, BatchResult(0.01), now + 0.01)
    else:
        assert sched.abort("a", now) is r
    assert r.state is S.ABORTED and r.finish_reason == "abort"
    assert sched.blocks.num_used == 0 and not sched.has_unfinished()
    sched.check_invariants()
    assert sched.abort("a", now) is None  # already gone


def test_default_and_explicit_deadlines():
    sched = toy_scheduler(min_ttft_deadline_s=0.5, ttft_deadline_factor=1.5)
    short, long_, own = (
        Request("s", 0.0, 64, 1),
        Request("l", 0.0, 4096, 1),
        Request("o", 1.0, 64, 1, ttft_deadline_s=2.0),
    )
    for r in (short, long_, own):
        sched.add_request(r, r.arrival_s)
    assert short.deadline_s == 0.5  # 1.5 x 62.5 ms is below the floor
    assert long_.deadline_s == pytest.approx(1.5 * 4.0)  # 4096 tokens at 1/1024 s
    assert own.deadline_s == 3.0
    fixed = toy_scheduler(ttft_deadline_s=7.0)
    r = Request("x", 1.0, 64, 1)
    fixed.add_request(r, 1.0)
    assert r.deadline_s == 8.0


def test_preemption_under_memory_pressure_loses_nothing():
    # 40 blocks of 16 tokens cannot hold twelve 40-token requests that each grow by 24.
    sched = toy_scheduler(num_blocks=40)
    rng = random.Random(3)
    reqs = [Request(f"r{i}", rng.uniform(0, 0.1), 40, 24) for i in range(12)]
    replay(sched, reqs, on_batch=lambda b, now: sched.check_invariants())
    assert sched.stats.preemptions > 0
    assert all(r.state is S.FINISHED and r.num_output_tokens == 24 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == sched.stats.preemptions
    assert sched.blocks.num_used == 0


def test_preempted_decode_recomputes_prompt_and_outputs():
    # Six 16-token blocks; two 47-token prompts fill three blocks each once they have their
    # first token. The next decode needs a fourth block: the older request evicts the newer.
    sched = toy_scheduler(num_blocks=6, watermark=0.0, iteration_budget_s=0.2)
    a, b = Request("a", 0.0, 47, 30), Request("b", 0.0, 47, 30)
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    _, now, _ = step(sched, 0.0)  # both prefills
    _, now, _ = step(sched, now)  # both decode into the third block
    batch, now, _ = step(sched, now)
    assert batch.preempted == [b] and b.state is S.PREEMPTED and b.num_computed == 0
    assert [c.request for c in batch.decodes] == [a]
    context = b.num_tokens
    assert context == 47 + 2
    chunks = []
    replay(
        sched,
        [],
        on_batch=lambda bt, t: chunks.extend(
            (c.start, c.end) for c in bt.prefills if c.request is b
        ),
    )
    # the whole context (prompt + generated tokens) was prefilled again from zero (memory is
    # so tight here that a partial re-prefill may itself be evicted and restart)
    last = max(i for i, c in enumerate(chunks) if c[0] == 0)
    tail = chunks[last:]
    assert tail[-1][1] == context
    assert all(x[1] == y[0] for x, y in zip(tail, tail[1:]))
    assert a.num_output_tokens == b.num_output_tokens == 30
    assert sched.blocks.num_used == 0


def test_a_batch_carries_each_chunks_tokens_and_block_table():
    # Tight memory, so that a request is preempted and recomputes prompt + outputs: every
    # chunk must still read the right tokens from its request and hold its live block table.
    sched = toy_scheduler(num_blocks=6, watermark=0.0, iteration_budget_s=0.2)
    reqs = [Request.from_tokens(n, 0.0, [hash((n, i)) % 1000 for i in range(47)], 30) for n in "ab"]
    for r in reqs:
        sched.add_request(r, 0.0)
    now, recomputed = 0.0, 0
    while sched.has_unfinished():
        batch = sched.schedule(now)
        for c in batch.chunks:
            r = c.request
            context = r.prompt_token_ids + r.output_token_ids
            assert c.token_ids == context[c.start : c.end]
            assert c.block_table is sched.blocks.blocks_of(r.request_id)  # the live list
            assert len(c.block_table) * sched.blocks.block_size >= c.end
            recomputed += c.start == 0 and r.num_output_tokens > 0
        tokens = {c.request.request_id: 7 + c.end for c in batch.chunks if c.samples}
        now += batch.predicted_time_s
        sched.update(batch, BatchResult(batch.predicted_time_s, tokens), now)
    assert recomputed and all(len(r.output_token_ids) == 30 for r in reqs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1),
            st.integers(1, 300),
            st.integers(1, 40),
            st.one_of(st.none(), st.integers(0, 30)),
            st.sampled_from(PRIORITY_CLASSES + (None,)),
        ),
        min_size=1,
        max_size=15,
    ),
    st.sampled_from(
        ["fcfs", "edf", "lrs", "lars", "srpt", "deferred", "aligned", "priority", "pla"]
    ),
    st.sampled_from(["adaptive", "static:64", "none"]),
    st.integers(24, 200),
    st.tuples(st.integers(1, 8), st.integers(1, 8), st.booleans()),
    st.tuples(
        st.sampled_from(["recompute", "swap", "auto"]),
        st.integers(1, 40),
        st.sampled_from([None, 0.0005]),
    ),
    st.booleans(),
)
# pla: the head of the line due at arrival + T_max, which arrival + T_max - arrival falls an
# ulp short of, woke the executor at that time again and again to release nothing
@example(
    specs=[(0.0, 1, 1, None, "REALTIME"), (0.5, 1, 1, None, "REALTIME")],
    policy="pla",
    chunking="adaptive",
    blocks=24,
    deferral=(1, 2, False),
    swapping=("recompute", 1, None),
    kvp=False,
)
def test_every_request_ends_and_no_block_leaks(
    specs, policy, chunking, blocks, deferral, swapping, kvp
):
    cap, k, prefill_only = deferral  # batch cap C and threshold K of the deferred policy
    # swap and auto with a host pool of 1-40 blocks; 0.0005 GB/s makes swapping about as
    # dear as recomputing on the toy predictor, so that auto takes both ways
    mode, host_blocks, bandwidth = swapping
    # aligned: a small memory threshold and min batch make it split the decodes into batches
    # (the toy predictor alone would always batch them all)
    # KV-cache parallel: 2 groups, a request's group 0 holding 16-64 tokens before group 1
    kvp_blocks = (
        KvpBlockManager(blocks // 2, 16, 2, 16 * (1 + k % 4))
        if kvp and mode == "recompute"
        else None
    )
    sched = toy_scheduler(
        policy=policy,
        chunking=chunking,
        num_blocks=blocks,
        batch_cap=cap,
        blocks=kvp_blocks,
        departure_threshold=min(k, cap),
        prefill_only_iterations=prefill_only,
        aligned_min_batch=k,
        aligned_memory_fraction=cap / 8,
        preemption_mode=mode,
        host_kv_blocks=host_blocks,
        swap_bandwidth_gbps=bandwidth,
        # pla: boundary 40-320 tokens; short prefills wait up to k/64 s, fixed
        # or adapted (Algorithm 1 or the SLA mode)
        pla_boundary_tokens=40 * k,
        pla_w_max_s=k / 64,
        pla_adaptive=k % 2 == 0,
        pla_mode=("sla", "awd", "token-max")[k % 3],
    )
    room = sched.blocks.capacity_tokens
    reqs = [
        Request(f"r{i}", t, p, o, priority_class=c)
        for i, (t, p, o, _, c) in enumerate(specs)
        if p + o <= room
    ]
    # abort each marked request once that many batches have run, wherever it is by then:
    # waiting, held back by its policy, prefilling, decoding or swapped out
    abort_at = {
        f"r{i}": ab for i, (t, p, o, ab, _) in enumerate(specs) if ab is not None and p + o <= room
    }
    now, pending = 0.0, sorted(reqs, key=lambda r: r.arrival_s)
    for _ in range(100_000):
        while pending and pending[0].arrival_s <= now:
            sched.add_request(pending.pop(0), now)
        batch = sched.schedule(now)
        if batch is None:
            # idle until the next arrival, or until a policy that holds prefills back (pla)
            # lets them go
            wake = sched.wake_at()
            assert wake is None or wake > now
            times = [pending[0].arrival_s] if pending else []
            times += [wake] if wake is not None else []
            if not times:
                break
            now = min(times)
            continue
        now += batch.predicted_time_s
        sched.update(batch, BatchResult(batch.predicted_time_s), now)
        for rid, after in list(abort_at.items()):
            if sched.get(rid) and sched.stats.batches >= after:
                sched.abort(rid, now)
                del abort_at[rid]
        sched.check_invariants()
    assert not sched.has_unfinished() and not pending
    assert all(r.state.is_done for r in reqs)
    assert sched.blocks.num_used == 0
    sched.check_invariants()
    assert sched.kv.swap_pool is None or sched.kv.swap_pool.num_free == host_blocks
    st_ = sched.stats
    assert st_.preemptions == st_.recomputes + st_.swap_outs


def test_a_discarded_batch_ends_its_requests_and_frees_their_kv():
    sched = toy_scheduler()
    for i, n in enumerate((300, 40)):
        sched.add_request(Request(f"r{i}", 0.0, n, 8), 0.0)
    sched.update(sched.schedule(0.0), BatchResult(0.01), 0.01)
    sched.add_request(Request("late", 0.02, 50, 8), 0.02)
    batch = sched.schedule(0.02)
    sched.abort("late", 0.02)  # aborted while the failing batch runs: released once, too
    gone = sched.discard(batch, 0.03)
    assert {r.request_id for r in gone} == {
        c.request.request_id for c in (*batch.prefills, *batch.decodes)
    }
    assert all(r.state is S.ABORTED for r in gone)
    assert all(not sched.blocks.blocks_of(r.request_id) for r in gone)
    assert sched.blocks.num_used == sum(
        len(sched.blocks.blocks_of(r.request_id)) for r in sched.live_requests()
    )
    sched.check_invariants()


def test_config_is_resolved_once_and_resolve_is_idempotent():
    sched = toy_scheduler(policy="pla", iteration_budget_s=None, tpot_target_s=0.08)
    cfg = sched.config
    assert cfg.is_resolved and cfg.iteration_budget_s == 0.08  # from the TPOT target
    assert resolve_config(cfg, sched.predictor) is cfg  # a resolved config is kept as it is
    # the packer and the policy read the scheduler's resolved config, not copies of their own
    assert sched.packer.config is cfg and sched.policy.config is cfg
    assert sched.packer.iteration_budget_s == sched.policy.config.iteration_budget_s == 0.08
    # a scheduler handed a resolved config keeps that very object
    assert ReplicaScheduler(cfg, sched.predictor, BlockManager(64)).config is cfg
    # an explicit budget is kept; resolve_config fills only what is missing
    explicit = SchedulerConfig(tpot_target_s=0.08, iteration_budget_s=0.03)
    assert resolve_config(explicit, sched.predictor).iteration_budget_s == 0.03


@pytest.mark.parametrize(
    "max_model_len, expected", [(8192, 2048), (4096, 1024), (1 << 20, 32768), (3, 1)]
)
def test_one_default_long_threshold(max_model_len, expected):
    assert default_long_threshold(max_model_len) == expected
    sched = toy_scheduler(max_model_len=max_model_len)
    assert sched.long_threshold == sched.config.long_prefill_threshold == expected
    assert (
        toy_scheduler(max_model_len=max_model_len, long_prefill_threshold=77).long_threshold == 77
    )


def test_waiting_and_prefilling_are_counted_apart():
    sched = toy_scheduler(policy="fcfs", multi_prefill=False)
    for i in range(3):
        sched.add_request(Request(f"r{i}", 0.0, 200, 2), 0.0)
    assert (sched.num_waiting, sched.num_prefilling) == (3, 0)
    step(sched, 0.0)  # r0's first 64-token chunk
    assert sched.prefill_counts() == (2, 1) == (sched.num_waiting, sched.num_prefilling)
    r0 = sched.get("r0")
    batch = sched.schedule(1.0)  # r0's second chunk, in flight: still prefilling
    assert r0.state is S.PREFILLING and sched.prefill_counts() == (2, 1)
    sched.update(batch, BatchResult(batch.predicted_time_s), 1.1)
    sched.drop_kv(batch, "r0")  # recompute: its KV is dropped, it waits to start over
    assert r0.state is S.PREEMPTED and sched.prefill_counts() == (3, 0)


@pytest.mark.parametrize("spp", [1, 2])
def test_a_decodes_own_tpot_target_caps_the_prefill_chunk_beside_it(spp):
    from medha.perf import ParallelConfig
    from medha.perf.toy_predictor import FixedCostPredictor

    def chunk_beside_decode(target):
        # 1/1024 s per token, no fixed cost: a budget of B seconds holds 1024 B tokens
        pred = FixedCostPredictor(1 / 1024)
        pred.parallel = ParallelConfig(spp=spp)
        sched = ReplicaScheduler(
            SchedulerConfig(policy="fcfs", iteration_budget_s=1 / 16, min_chunk_tokens=4),
            pred,
            BlockManager(1 << 12),
        )
        d = Request("d", 0.0, 8, 50, tpot_target_s=target)
        sched.add_request(d, 0.0)
        step(sched, 0.0)  # d's prompt: it decodes from here
        assert d.state is S.DECODING
        # p arrives as d's first token comes: d's next one is due one target later (a mean
        # over its answer: time d spent idle before p came would be owed)
        now = d.first_token_s
        sched.add_request(Request("p", now, 4000, 1, tpot_target_s=0.001), now)
        batch = sched.schedule(now)
        assert [c.request.request_id for c in batch.decodes] == ["d"]
        return batch.prefills[0].num_tokens, batch.predicted_time_s

    # the configured budget (1/16 s = 64 tokens) without a target of its own, or a looser one
    assert chunk_beside_decode(None) == (63, 1 / 16)
    assert chunk_beside_decode(0.5) == (63, 1 / 16)
    # a 20 ms target: the batch gets 20 ms (x spp/(spp+1) when pipelined, as the default);
    # p's own 1 ms target does not count while p is in prefill (TTFT judges it, not TPOT)
    n, t = chunk_beside_decode(0.02)
    budget = 0.02 if spp == 1 else 0.02 * spp / (spp + 1)
    assert n == int(budget * 1024) - 1 and t <= budget
    # a target no batch can meet still leaves one minimum chunk (4 tokens) for the prefills
    assert chunk_beside_decode(1e-9) == (4, 5 / 1024)


@pytest.mark.parametrize("policy", ["lars", "edf", "fcfs", "priority"])
@pytest.mark.parametrize("overload_steps", [True, False])
def test_prefills_short_of_memory_never_evict_each_other_forever(policy, overload_steps):
    """Eight 2,048-token prompts (long here) in a cache of 300 blocks (about two of them): each
    starts when its whole context fits beside what the others hold so far, and the started
    ones then outgrow the cache. A started prefill keeps its KV by admission order, so one
    evicted cannot evict the one that evicted it: every prompt finishes. Ranked by LARS's
    slack key, which rises as a prefill is served, they took turns evicting each other and
    none finished in 20,000 batches (8,415 preemptions)."""
    sched = toy_scheduler(
        policy,
        num_blocks=300,
        long_prefill_threshold=1024,
        arrival_wait_s=0.25,
        preemption_mode="recompute",
        overload_steps=overload_steps,
    )
    reqs = [Request(f"r{i}", i * 0.05, 2048, 50) for i in range(8)]
    batches = 0

    def on_batch(batch, now):
        nonlocal batches
        batches += 1
        assert batches < 20_000, f"{sum(r.finish_s is not None for r in reqs)} of 8 done"
        sched.check_invariants()

    replay(sched, reqs, on_batch=on_batch)
    assert all(r.finish_s is not None for r in reqs)
    assert sched.kv.stats.preemptions < 50
