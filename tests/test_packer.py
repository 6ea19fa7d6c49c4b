import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha.core.batch import BatchResult
from medha.core.config import CHUNKING_MODES, parse_chunking
from medha.core.request import Request
from medha.perf import ParallelConfig, make_predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config
from medha.scheduler.packers import PACKERS, make_packer
from medha.scheduler.policies.lars_policy import LarsPolicy
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.sim.replay import replay

H100_8B_TP8 = make_predictor("roofline", "llama-3-8b", "h100", ParallelConfig(tp=8))


def gpu_scheduler(num_blocks=1 << 16, **config) -> ReplicaScheduler:
    config.setdefault("iteration_budget_s", 0.05)
    return ReplicaScheduler(
        SchedulerConfig.from_flat(**config), H100_8B_TP8, BlockManager(num_blocks)
    )


def check_budget(batch, budget, min_chunk, arrival_wait=None):
    """The packer's contract: within budget (a batch without decodes within `arrival_wait`
    when given: nobody may wait on it), except (a) a minimum chunk in an otherwise empty
    batch when not even one token fits, or (b) decodes alone, which always run."""
    if not batch.decodes and arrival_wait is not None:
        budget = max(budget, arrival_wait)
    if batch.predicted_time_s <= budget * (1 + 1e-9):
        return
    if not batch.prefills:
        return
    assert not batch.decodes and len(batch.prefills) == 1, batch.describe()
    assert batch.prefills[0].num_tokens <= min_chunk, batch.describe()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 2), st.integers(1, 40_000), st.integers(1, 30)),
        min_size=1,
        max_size=10,
    ),
    st.sampled_from(["fcfs", "edf", "lrs", "lars", "srpt"]),
    st.sampled_from([0.02, 0.05, 0.2]),
    st.booleans(),
)
def test_adaptive_batches_stay_within_budget(specs, policy, budget, multi):
    # room for every request whole, twice over: no memory pressure (as with 65,536 blocks),
    # and a block check per batch of a few thousand blocks instead of 65,536
    blocks = 2 * sum(-(-(p + o) // 16) for _, p, o in specs)
    sched = gpu_scheduler(
        blocks, policy=policy, iteration_budget_s=budget, multi_prefill=multi, max_model_len=65_536
    )
    reqs = [Request(f"r{i}", t, p, o) for i, (t, p, o) in enumerate(specs)]

    def check(batch, now):
        check_budget(batch, budget, sched.config.min_chunk_tokens, sched.config.arrival_wait_s)
        sched.check_invariants()

    replay(sched, reqs, on_batch=check)
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert sched.blocks.num_used == 0


def test_chunks_shrink_as_the_kv_grows():
    packer = make_packer(SchedulerConfig(iteration_budget_s=0.05), H100_8B_TP8)
    chunks, k = [], 0
    while k < 1_000_000:
        n = packer.plan_isolated(k, 1_000_000 - k)
        assert H100_8B_TP8.shape_time([(n, k)]) <= 0.05
        chunks.append(n)
        k += n
    full = chunks[:-1]  # the last chunk is whatever is left
    assert all(a >= b for a, b in zip(full, full[1:]))
    assert full[0] > 5000 and full[-1] < 500


def test_space_sharing_leaves_room_while_a_long_prefill_has_slack():
    # LARS's own order (serve-early off): the long prefill leads and shares
    sched = gpu_scheduler(long_prefill_threshold=32_768, lars_serve_early=False)
    sched.add_request(Request("long", 0.0, 200_000, 1, ttft_deadline_s=1000.0), 0.0)
    alone = sched.schedule(0.0)
    # nobody behind it: nothing to leave room for, it takes the whole budget
    assert alone.predicted_time_s > 0.95 * 0.05
    sched.update(alone, BatchResult(alone.predicted_time_s), alone.predicted_time_s)
    sched.add_request(Request("short", 0.05, 100, 1, ttft_deadline_s=1000.0), 0.05)
    batch = sched.schedule(0.05)
    long_chunk, short_chunk = batch.prefills
    assert (long_chunk.request.request_id, short_chunk.request.request_id) == ("long", "short")
    # rho is far above rho_max, so its own chunk may use only (1 - 0.4) of the 50 ms budget
    own = H100_8B_TP8.shape_time([(long_chunk.num_tokens, long_chunk.start)])
    assert 0.5 * 0.05 < own <= 0.6 * 0.05


def test_without_multi_prefill_a_long_prefill_yields_nothing():
    # One prefill per batch: the share it would leave could carry no other prefill
    sched = gpu_scheduler(
        long_prefill_threshold=32_768, multi_prefill=False, lars_serve_early=False
    )
    sched.add_request(Request("long", 0.0, 200_000, 1, ttft_deadline_s=1000.0), 0.0)
    sched.add_request(Request("short", 0.0, 100, 1, ttft_deadline_s=1000.0), 0.0)
    batch = sched.schedule(0.0)
    assert [c.request.request_id for c in batch.prefills] == ["long"]
    assert batch.predicted_time_s > 0.95 * 0.05


@pytest.mark.parametrize("per", ["remaining", "total"])
def test_space_sharing_yields_by_the_lars_formula(per):
    # A long prefill with 3/4 of its work left over (as if the rest were done) and slack
    # 0.2 x w_total: rho is 0.2 over the whole prefill's work, 0.8 over the work left; the share
    # it yields is the rho of --lars-slack (rho_max raised so that neither is clamped).
    sched = gpu_scheduler(
        long_prefill_threshold=32_768, lars_slack=per, rho_max=0.9, lars_serve_early=False
    )
    long_ = Request("long", 0.0, 200_000, 1)
    sched.add_request(long_, 0.0)
    sched.add_request(Request("short", 0.0, 100, 1, ttft_deadline_s=1000.0), 0.0)
    long_.remaining_work_s = long_.total_work_s / 4
    long_.deadline_s = long_.remaining_work_s + 0.2 * long_.total_work_s
    rho = {"total": 0.2, "remaining": 0.8}[per]
    assert long_.relative_slack(0.0, per) == pytest.approx(rho)
    batch = sched.schedule(0.0)
    long_chunk = batch.prefills[0]
    assert long_chunk.request is long_
    own = H100_8B_TP8.shape_time([(long_chunk.num_tokens, long_chunk.start)])
    assert 0.95 * (1 - rho) * 0.05 < own <= (1 - rho) * 0.05


def test_shorts_fill_what_a_long_prefill_leaves():
    sched = gpu_scheduler(long_prefill_threshold=32_768, lars_serve_early=False)
    work = sched.predicted_isolated_prefill_s(200_000)
    # relative slack 1.5: ahead of the short requests (whose slack is many times their work),
    # yet enough slack to yield rho_max of the budget to them
    sched.add_request(Request("long", 0.0, 200_000, 1, ttft_deadline_s=2.5 * work), 0.0)
    for i in range(3):
        sched.add_request(Request(f"s{i}", 0.0, 2000, 1), 0.0)
    batch = sched.schedule(0.0)
    first, *rest = batch.prefills
    assert first.request.request_id == "long" and rest
    assert H100_8B_TP8.shape_time([(first.num_tokens, 0)]) <= 0.6 * 0.05
    assert 0.9 * 0.05 < batch.predicted_time_s <= 0.05


@pytest.mark.parametrize("long_slack", [10.0, 0.001, -1.0])
def test_lars_serves_a_short_prefill_early_where_no_one_misses_for_it(long_slack):
    # The long prefill's rho (slack / work) is far below the short one's, so LARS's key puts it
    # first. With 10 s of slack it can spare the short one's few milliseconds: the short goes
    # first. With 1 ms it cannot: LARS's order stands. Past its deadline (slack < 0) it misses
    # either way, and holds no one back.
    sched = gpu_scheduler(long_prefill_threshold=32_768)
    long_ = Request("long", 0.0, 200_000, 1)
    sched.add_request(long_, 0.0)
    short = Request("short", 0.0, 100, 1, ttft_deadline_s=1000.0)
    sched.add_request(short, 0.0)
    long_.deadline_s = long_.remaining_work_s + long_slack
    assert long_.relative_slack(0.0, "total") < short.relative_slack(0.0, "total")
    assert short.remaining_work_s < 0.01
    order = [c.request.request_id for c in sched.schedule(0.0).prefills]
    assert order == (["long", "short"] if long_slack == 0.001 else ["short", "long"])


def test_serve_early_keeps_the_slack_of_every_request_it_passes():
    # Two shorts behind a long prefill whose slack covers only one of them: the first moves
    # ahead, the second keeps its place behind the long one.
    lars = LarsPolicy(SchedulerConfig(long_prefill_threshold=32_768))

    def req(name, tokens, work, slack):
        r = Request(name, 0.0, tokens, 1)
        r.remaining_work_s = r.total_work_s = work
        r.deadline_s = work + slack
        return r

    long_ = req("long", 100_000, 10.0, 0.015)
    a, b = req("a", 100, 0.01, 5.0), req("b", 100, 0.01, 5.0)
    assert lars.serve_early([long_, a, b], 0.0) == [a, long_, b]
    # a long request is never moved, whatever the slack ahead of it
    other = req("other", 50_000, 0.001, 5.0)
    assert lars.serve_early([long_, other], 0.0) == [long_, other]


@pytest.mark.parametrize("big_slack", [0.5, 0.015, -1.0])
def test_small_prefills_pass_a_short_one_with_more_work_than_the_arrival_wait(big_slack):
    # A 6,000-token prompt is short by a 32K threshold, but 0.4 s of work is longer than a
    # request arriving behind it may wait (0.2 s). LARS's key puts it first (its slack is small
    # for its work); two small prefills pass it where its slack covers them (0.5 s: both; 15
    # ms: one), and it still passes a long prefill. Before, as a short prefill it went "early"
    # first and nobody passed it: the shorts waited out its whole prefill.
    lars = LarsPolicy(SchedulerConfig(long_prefill_threshold=32_768, arrival_wait_s=0.2))

    def req(name, tokens, work, slack):
        r = Request(name, 0.0, tokens, 1)
        r.remaining_work_s = r.total_work_s = work
        r.deadline_s = work + slack
        return r

    big = req("big", 6_000, 0.4, big_slack)
    a, b = req("a", 64, 0.01, 0.49), req("b", 64, 0.01, 0.49)
    long_ = req("long", 100_000, 10.0, 5.0)
    order = lars.serve_early([big, a, b, long_], 0.0)
    expected = {0.5: [a, b, big, long_], 0.015: [a, big, b, long_], -1.0: [a, b, big, long_]}
    assert order == expected[big_slack]
    # with an arrival wait longer than its work it is small too: it keeps its place ahead
    small = LarsPolicy(SchedulerConfig(long_prefill_threshold=32_768, arrival_wait_s=0.5))
    assert small.serve_early([big, a, b, long_], 0.0) == [big, a, b, long_]
    # large ones pass a long one by its slack alone, in LARS's order among themselves, as
    # every short prefill did before: the first one's small slack holds back only small ones
    other = req("other", 6_000, 0.4, 5.0)
    assert lars.serve_early([long_, big, other], 0.0) == [big, other, long_]


def test_a_lone_long_prefill_runs_steps_of_the_arrival_wait():
    # Nobody waits on its steps: it runs steps of arrival_wait_s, longer than the budget; a
    # short request waiting beside it brings the steps back to the budget.
    sched = gpu_scheduler(long_prefill_threshold=32_768, iteration_budget_s=None)
    budget, wait = sched.config.iteration_budget_s, sched.config.arrival_wait_s
    assert wait > 2 * budget
    sched.add_request(Request("long", 0.0, 200_000, 1), 0.0)
    alone = sched.schedule(0.0)
    assert budget < alone.predicted_time_s <= wait
    now = alone.predicted_time_s
    sched.update(alone, BatchResult(now), now)
    sched.add_request(Request("short", now, 100, 1), now)
    both = sched.schedule(now)
    assert len(both.prefills) == 2 and both.predicted_time_s <= budget * (1 + 1e-9)


@pytest.mark.parametrize("decode_late, shorts_late", [(True, True), (False, True), (True, False)])
def test_under_overload_late_requests_wait_on_no_step(decode_late, shorts_late):
    # A request past its TTFT deadline (still waiting, or decoding after a late first token)
    # can no longer meet its SLO: when every one is, the step runs to the arrival wait (the
    # queue drains sooner); one on time brings it back to the budget.
    sched = gpu_scheduler(long_prefill_threshold=32_768, iteration_budget_s=None)
    budget, wait = sched.config.iteration_budget_s, sched.config.arrival_wait_s
    first = Request("decoder", 0.0, 100, 50, ttft_deadline_s=0.5)
    sched.add_request(first, 0.0)
    done = 1.0 if decode_late else 0.1  # its first token after or before its deadline
    sched.update(sched.schedule(0.0), BatchResult(done), done)
    assert first.first_token_s == done
    for i in range(2):  # (the default deadline, 0.5 s: a told one waits on its latest start)
        sched.add_request(Request(f"short{i}", done, 100, 1), done)
    sched.add_request(Request("long", done, 200_000, 1), done)
    now = done + (0.6 if shorts_late else 0.1)
    batch = sched.schedule(now)
    assert len(batch.decodes) == 1 and len(batch.prefills) == 3
    if decode_late and shorts_late:
        assert budget < batch.predicted_time_s <= wait
    else:
        assert batch.predicted_time_s <= budget * (1 + 1e-9)


def test_work_and_deadlines_are_planned_at_the_budget_not_the_arrival_wait():
    # A long prefill runs arrival-wait steps only while alone; beside anyone it gets the
    # budget. Its work w_r, and the default deadline scaled from it, follow the budget's
    # steps, or long deadlines come sooner than any loaded replica meets them.
    sched = gpu_scheduler(long_prefill_threshold=32_768, iteration_budget_s=None)
    budget, wait = sched.config.iteration_budget_s, sched.config.arrival_wait_s
    assert wait > 2 * budget
    cache, pred = sched.prefill_times, sched.predictor
    cache.time(200_000)
    steps = list(zip(cache.chunks, cache.boundaries))
    assert all(pred.prefill_step_time(n, k) <= budget for n, k in steps[:-1])
    assert max(pred.prefill_step_time(n, k) for n, k in steps) > 0.9 * budget
    r = Request("long", 0.0, 200_000, 1)
    sched.add_request(r, 0.0)
    assert r.deadline_s == pytest.approx(1.5 * cache.time(200_000))
    assert r.total_work_s == pytest.approx(cache.time(200_000))
    # what it runs alone is faster than that plan: the arrival wait's few large steps
    alone = sched.schedule(0.0)
    assert alone.prefills[0].num_tokens > cache.chunks[0]


def test_at_most_one_long_prefill_per_batch():
    sched = gpu_scheduler(long_prefill_threshold=32_768)
    for i in range(2):
        sched.add_request(Request(f"long{i}", 0.0, 100_000, 1, ttft_deadline_s=0.5), 0.0)
    for _ in range(5):
        batch = sched.schedule(0.0)
        assert sum(c.request.prompt_len >= 32_768 for c in batch.prefills) == 1
        sched.update(batch, BatchResult(0.05), 0.05)


@pytest.mark.parametrize("budget", [0.005, 0.01])
def test_a_step_with_no_room_for_a_chunk_leaves_the_prefill_queue_unordered(budget):
    """Ordering the waiting prefills is a large share of the scheduler's work at a few hundred
    requests (issue 69): a step whose decodes already take the budget (one decode of Llama-3-8B on
    8 H100s is 5.7 ms by the roofline) runs them alone without ordering anyone, as the
    packer's loop would have stopped at its first request; with room (10 ms), the queue is
    ordered once and its first request gets a chunk."""
    sched = gpu_scheduler(policy="lars", iteration_budget_s=budget, max_model_len=8192)
    sched.add_request(Request("d", 0.0, 64, 1000), 0.0)
    now = 0.0
    while not sched.requests.decoding:  # (at 5 ms: two minimum chunks, each past the budget)
        batch = sched.schedule(now)
        now += batch.predicted_time_s
        sched.update(batch, BatchResult(batch.predicted_time_s), now)
    for i in range(3):
        sched.add_request(Request(f"p{i}", now, 2000, 4), now)
    orders = []
    order_prefills = sched.policy.order_prefills
    sched.policy.order_prefills = lambda *args: orders.append(args) or order_prefills(*args)
    batch = sched.schedule(now)
    assert [c.request.request_id for c in batch.decodes] == ["d"]
    if budget == 0.005:
        assert batch.predicted_time_s > budget and not batch.prefills and not orders
    else:
        assert len(orders) == 1 and [c.request.request_id for c in batch.prefills][:1] == ["p0"]


@pytest.mark.parametrize("multi", [True, False])
def test_multi_prefill_switch(multi):
    sched = gpu_scheduler(multi_prefill=multi)
    for i in range(4):
        sched.add_request(Request(f"s{i}", 0.0, 200, 1), 0.0)
    batch = sched.schedule(0.0)
    assert len(batch.prefills) == (4 if multi else 1)


def test_static_chunking_caps_tokens_and_keeps_arrival_order():
    sched = gpu_scheduler(chunking="static:512")
    assert sched.policy.name == "fcfs"  # Sarathi's baseline
    reqs = [Request(f"r{i}", 0.01 * i, 300 + 100 * i, 20) for i in range(6)]
    first_chunk = {}

    def check(batch, now):
        assert batch.num_tokens <= 512
        for c in batch.prefills:
            first_chunk.setdefault(c.request.request_id, batch.batch_id)

    replay(sched, reqs, on_batch=check)
    starts = [first_chunk[r.request_id] for r in reqs]
    assert starts == sorted(starts)


def test_no_chunking_runs_each_prompt_whole():
    sched = gpu_scheduler(chunking="none")
    reqs = [Request("long", 0.0, 300_000, 4), Request("short", 0.001, 100, 4)]
    chunks = []
    replay(
        sched,
        reqs,
        on_batch=lambda b, now: chunks.extend(
            (c.request.request_id, c.start, c.num_tokens) for c in b.prefills
        ),
    )
    assert chunks == [("long", 0, 300_000), ("short", 0, 100)]
    # the short request waited for the whole long prefill: the convoy effect
    assert reqs[1].ttft_s > reqs[0].ttft_s * 0.9


@pytest.mark.parametrize(
    "spec", ["static", "static:0", "static:x", "chunky", "none:5", "adaptive:3", ""]
)
def test_bad_chunking_specs(spec):
    with pytest.raises(ValueError, match="chunking"):
        parse_chunking(spec)


def test_every_chunking_mode_has_a_packer():
    # the config checks names against its list; the registry must implement exactly those
    assert PACKERS.names() == sorted(CHUNKING_MODES)


def test_default_budget_leaves_room_for_a_pipeline_slot():
    cfg = SchedulerConfig(tpot_target_s=0.06)

    def budget(config, spp):
        return resolve_config(
            config, make_predictor("roofline", "llama-3-8b", "h100", ParallelConfig(spp=spp))
        ).iteration_budget_s

    assert budget(cfg, 1) == 0.06  # a batch returns exactly when the next one starts
    assert budget(cfg, 2) == pytest.approx(0.04)  # a decode may wait one stage (latency/2)
    assert budget(cfg, 4) == pytest.approx(0.048)
    assert budget(SchedulerConfig(tpot_target_s=0.06, iteration_budget_s=0.03), 4) == 0.03
