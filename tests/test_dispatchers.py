"""The dispatchers over both fronts: SimReplica (the simulator's, read from the real scheduler)
and TrackedReplica (the router's model of a server, fed the router's events). Toy timing: a
token costs TOKEN_S, so a prompt of n tokens is n / 1024 s of prefill work."""

import dataclasses

import pytest
from conftest import TOKEN_S

from medha.core.request import Request
from medha.dispatch.base_dispatcher import DISPATCHERS, DecodeShare, Pending
from medha.perf import ParallelConfig
from medha.perf.toy_predictor import TOY_MODEL, FixedCostPredictor
from medha.route.tracked import PrefixIndex, TrackedReplica
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config
from medha.scheduler.packers import replica_policy, replica_prefill_times
from medha.scheduler.policies.config import LarsSettings
from medha.scheduler.replica_rules import prefill_order
from medha.sim.config import ClusterConfig
from medha.sim.simulator import Simulator


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def tracked_cluster(n=2, policy=None, cache_tokens=1 << 20, **sched):
    sched.setdefault("iteration_budget_s", 1 / 16)
    predictor = FixedCostPredictor(TOKEN_S)
    config = resolve_config(SchedulerConfig.from_flat(policy=policy, **sched), predictor)
    prefill_times = replica_prefill_times(config, predictor)  # as the router builds them
    clock = Clock()
    replicas = [
        TrackedReplica(i, predictor, config, prefill_times, 16, cache_tokens, clock)
        for i in range(n)
    ]
    return replicas, config, clock


def dispatcher(name, replicas, config):
    return DISPATCHERS.get(name)(replicas, ClusterConfig(replicas=len(replicas)), config)


def tokens(prefix: int, n: int, seed: int = 0) -> list[int]:
    """A prompt of n tokens whose first `prefix` are shared by every prompt of that prefix."""
    return [7] * prefix + [1000 + seed * 7919 + i for i in range(n - prefix)]


def send(replica, d_config, request, expected=4):
    allowed = d_config.ttft_allowed_s(request.ttft_deadline_s, replica.prefill_work_s(request, 0))
    replica.on_dispatch(request, request.arrival_s + allowed, expected)


def test_the_tracked_replica_drains_waiting_work_in_deadline_order_and_learns_first_tokens():
    (r,), config, clock = tracked_cluster(1)
    long = Request.from_tokens("long", 0.0, tokens(0, 2048), 4)  # 2 s of work, deadline 3 s
    short = Request.from_tokens("short", 0.0, tokens(0, 256, 1), 4)  # 0.25 s, deadline 0.5 s
    send(r, config, long)
    send(r, config, short)
    assert sorted(p.work_s for p in r.pending(0.0)) == pytest.approx([0.25, 2.0])
    clock.t = 0.5  # the short one (earlier deadline) is done, the long one has 1.75 s left
    assert {p.request_id: p.work_s for p in r.pending(0.5)} == pytest.approx(
        {"short": 0.0, "long": 1.75}
    )
    r.on_first_token("short")
    assert [p.request_id for p in r.pending(0.5)] == ["long"]
    assert r._decode_contexts() == [short.prompt_len + 1]  # it decodes now
    r.on_end("short")
    r.on_end("long")
    assert r.pending(1.0) == [] and not r.busy() and r.outstanding_work_s() == 0
    assert r.progress(short)[0] == 0.5 and r.progress(short)[2]


def test_the_tracked_replica_learns_its_slowdown_over_busy_periods():
    (r,), config, clock = tracked_cluster(1)
    solo = Request.from_tokens("solo", 0.0, tokens(0, 1024), 4)  # 1 s predicted, alone
    send(r, config, solo)
    clock.t = 1.5  # the replica took 1.5x its profile
    r.on_first_token("solo")
    assert r.slowdown == pytest.approx(1.5)  # the first sample counts in full
    r.on_end("solo")
    # two sent together (2 s of work at the profile's speed): one sample of their busy period,
    # from the first one's dispatch to the last first token, whichever came first
    for name, i in (("a", 1), ("b", 2)):
        send(r, config, Request.from_tokens(name, clock.t, tokens(0, 1024, i), 4))
    clock.t = 1.5 + 2.0 * 1.5  # at 1.5x again
    r.on_first_token("b")
    r.on_first_token("a")
    assert r.slowdown == pytest.approx(1.5)
    clock.t += 4.0  # (decodes ended)
    for name in ("a", "b"):
        r.on_end(name)
    # a period in which a request ended without its first token is no sample: its work was
    # not all done
    for name, i in (("c", 3), ("d", 4)):
        send(r, config, Request.from_tokens(name, clock.t, tokens(0, 1024, i), 4))
    r.on_end("c")  # (the client left)
    clock.t += 3.0
    r.on_first_token("d")  # (3 s for 2 s of work: a sample would have moved it)
    assert r.slowdown == pytest.approx(1.5)
    r.on_end("d")
    # nor is a period with a whole answer in it (its first token is its end)
    r.on_dispatch(Request.from_tokens("w", clock.t, tokens(0, 1024, 5), 4), clock.t + 9, 4, False)
    send(r, config, Request.from_tokens("e", clock.t, tokens(0, 1024, 6), 4))
    clock.t += 0.5
    r.on_first_token("e")  # (0.5 s for 1 s of work)
    assert r.slowdown == pytest.approx(1.5)
    # the slowdown (and the decodes now running) stretch the drain and the prediction
    f = Request.from_tokens("f", clock.t, tokens(0, 1024, 7), 4)
    send(r, config, f)
    assert r.prefill_stretch() > 1.5


def test_the_tracked_replica_reads_the_step_by_the_packers_rule_of_who_waits():
    # Nobody waits on the step (nothing decodes; one prefill, or long ones only): up to the
    # arrival wait; a short prefill beside another brings it back to the budget
    # (replica_rules.step_budget_s).
    (r,), config, clock = tracked_cluster(
        1, iteration_budget_s=1 / 16, arrival_wait_s=0.25, long_prefill_threshold=1024
    )
    for i in range(2):
        send(r, config, Request.from_tokens(f"long{i}", 0.0, tokens(0, 4096, i), 4))
    assert r.iteration_left_s(0.0) == pytest.approx(0.5 * 0.25)
    send(r, config, Request.from_tokens("short", 0.0, tokens(0, 256, 9), 4))
    assert r.iteration_left_s(0.0) == pytest.approx(0.5 / 16)
    # under overload a request past its deadline waits on no step: the short one's 0.5 s
    # deadline has passed, the long ones' have not
    clock.t = 1.0
    assert r.iteration_left_s(1.0) == pytest.approx(0.5 * 0.25 * r.slowdown)
    # one decoding after an on-time first token waits on every step
    send(r, config, Request.from_tokens("chat", 1.0, tokens(0, 64, 7), 4))
    clock.t = 1.1
    r.on_first_token("chat")
    assert r.iteration_left_s(1.1) == pytest.approx(0.5 / 16 * r.slowdown)


def test_pending_requests_are_ordered_as_the_replica_scheduler_orders_its_prefills():
    lars = replica_policy(resolve_config(SchedulerConfig(), FixedCostPredictor(TOKEN_S)))
    assert lars.name == "lars"  # the adaptive packer's default
    long_at = lars.config.long_prefill_threshold

    def order(policy, pending):
        return [p.request_id for p in prefill_order(policy, pending, 0.0, long_at)]

    # LARS: relative slack over the whole prefill's work; the long one is the more urgent,
    # (12-8)/8 < (1-.2)/.2, but the short one's 0.2 s fit in its 4 s of slack: served early
    long = Pending("long", 0.0, 12.0, work_s=8.0, total_work_s=8.0, num_uncached_tokens=long_at)
    short = Pending("short", 0.0, 1.0, work_s=0.2, total_work_s=0.2, num_uncached_tokens=200)
    assert order(lars, [short, long]) == ["short", "long"]
    by_key = replica_policy(dataclasses.replace(lars.config, lars=LarsSettings(serve_early=False)))
    assert order(by_key, [short, long]) == ["long", "short"]
    edf = replica_policy(SchedulerConfig(policy="edf"))
    assert order(edf, [long, short]) == ["short", "long"]
    # a short prefill under way goes first whatever the key
    started = Pending("started", 0.0, 20.0, 1.0, 2.0, num_uncached_tokens=2000, started=True)
    assert order(edf, [long, short, started]) == ["started", "short", "long"]


def test_the_slowdown_weighs_periods_by_their_length_and_forgets_past_its_window():
    (r,), config, clock = tracked_cluster(1)

    def sample(i, n, took):  # n tokens alone (n / 1024 s predicted), first token after `took`
        send(r, config, Request.from_tokens(f"s{i}", clock.t, tokens(0, n, i), 4))
        clock.t += took
        r.on_first_token(f"s{i}")
        r.on_end(f"s{i}")

    sample(0, 1024, 2.0)
    assert r.slowdown == pytest.approx(2.0)  # the first counts in full
    # a short one at 3x moves it by its length, not as much as a long one would
    sample(1, 128, 0.375)
    assert 2.0 < r.slowdown < 2.2  # (2.11; a 1 s period at 3x: 2.56)
    # short prompts alone teach the speed: 25 s of them at 1x leave the first ones nothing
    for i in range(200):
        sample(2 + i, 128, 0.125)
    assert r.slowdown == pytest.approx(1.0, abs=0.01)
    # the round trip is not the replica's: a period that took its prefill and the round trip
    # measures 1x; one stalled far past any speed is clipped
    r.round_trip_s = 0.05
    sample(300, 1024, 1.05)
    assert r.slowdown == pytest.approx(1.0, abs=0.01)
    sample(301, 1024, 60.0)
    assert r.slowdown < 3.0


def test_a_replica_that_measured_nothing_runs_as_its_peers_of_the_same_model():
    # (the router gives every replica the list of them all)
    replicas, config, clock = tracked_cluster(4)
    a, b, c, other = replicas
    for r in replicas:
        r.peers = replicas
    model = FixedCostPredictor(TOKEN_S, model=dataclasses.replace(TOY_MODEL, name="other"))
    other.set_model(model, config, replica_prefill_times(config, model))
    for r, took in ((a, 2.0), (b, 3.0)):  # 1 s of work alone on each
        send(r, config, Request.from_tokens(f"on{r.replica_id}", clock.t, tokens(0, 1024), 4))
        clock.t += took
        r.on_first_token(f"on{r.replica_id}")
        r.on_end(f"on{r.replica_id}")
    assert (a.slowdown, b.slowdown) == (2.0, 3.0)  # each its own
    assert c.slowdown == pytest.approx(2.5)  # theirs, while it has measured nothing
    assert other.slowdown == 1.0  # priced with another model: theirs is not its
    # its first period of its own is its speed from then on
    send(c, config, Request.from_tokens("c", clock.t, tokens(0, 1024, 1), 4))
    clock.t += 1.2
    c.on_first_token("c")
    assert c.slowdown == pytest.approx(1.2)


def test_decodes_stretch_prefill_by_their_marginal_share_of_the_budget():
    predictor = FixedCostPredictor(TOKEN_S)
    share = DecodeShare(predictor, 1 / 16)
    assert share.stretch([]) == 1.0
    few, many = share.stretch([512] * 2), share.stretch([512] * 64)
    assert 1.0 < few < many <= 1 / (1 - DecodeShare.MAX_SHARE)
    assert DecodeShare(predictor, None).stretch([512] * 8) == 1.0


def test_the_prefix_index_matches_chained_keys_and_forgets_the_least_recently_sent():
    (r,), config, clock = tracked_cluster(1, cache_tokens=64)  # 4 blocks of 16
    a = Request.from_tokens("a", 0.0, tokens(48, 64), 4)
    send(r, config, a)
    b = Request.from_tokens("b", 0.0, tokens(48, 80, 2), 4)
    assert r.cached_tokens(b) == 48  # three shared blocks; the fourth differs
    send(r, config, b)  # five blocks: the oldest of a's go first
    assert r.cached_tokens(Request.from_tokens("c", 0.0, tokens(48, 64), 4)) == 0
    index = PrefixIndex(2)
    index.add(["x", "y"])
    index.add(["z"])
    assert index.match(["x"], 1) == 0 and index.match(["y", "z"], 2) == 2


def test_round_robin_passes_over_replicas_left_out():
    replicas, config, _ = tracked_cluster(3)
    rr = dispatcher("round_robin", replicas, config)
    r = Request("x", 0.0, 8, 1)
    picks = [rr.pick(r, 0.0, [replicas[0], replicas[2]]).replica_id for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_prefix_affinity_holds_only_within_the_load_bound():
    replicas, config, clock = tracked_cluster(2)
    prefix = dispatcher("prefix", replicas, config)
    warm = Request.from_tokens("warm", 0.0, tokens(512, 600), 4)
    send(replicas[0], config, warm)
    replicas[0].on_first_token("warm")
    replicas[0].on_end("warm")
    hit = Request.from_tokens("hit", 0.0, tokens(512, 600, 1), 4)
    assert prefix.pick(hit, 0.0).replica_id == 0  # the cache, both idle
    # replica 0 busy past the bound (one least deadline, 0.5 s, of work above replica 1's)
    send(replicas[0], config, Request.from_tokens("big", 0.0, tokens(0, 1024, 3), 4))
    assert replicas[0].outstanding_work_s() > config.min_ttft_deadline_s
    assert prefix.pick(hit, 0.0).replica_id == 1


def test_slack_takes_the_cache_unless_the_queue_behind_it_costs_more():
    replicas, config, clock = tracked_cluster(2)
    slack = dispatcher("slack", replicas, config)
    warm = Request.from_tokens("warm", 0.0, tokens(2048, 2100), 4)
    send(replicas[0], config, warm)
    t = clock.t = replicas[0].pending(0.0)[0].work_s  # its first token when predicted
    replicas[0].on_first_token("warm")
    replicas[0].on_end("warm")
    assert replicas[0].slowdown == pytest.approx(1.0)
    hit = Request.from_tokens("hit", t, tokens(2048, 2100, 1), 4)
    assert replicas[0].cached_tokens(hit) == 2048
    assert slack.pick(hit, t).replica_id == 0  # 0.05 s of work there, 2 s on replica 1
    # a queue of 3 s of prefill ahead on replica 0 (earlier deadlines): replica 1 is sooner
    for i in range(3):
        send(replicas[0], config, Request.from_tokens(f"q{i}", t, tokens(0, 1024, 10 + i), 4))
    assert slack.pick(hit, t).replica_id == 1


@pytest.mark.parametrize("waited_s", [0.0, 1.0])
def test_slack_breaks_a_tie_within_its_tolerance_by_the_replica_time_a_choice_spends(waited_s):
    # replica 1 holds the new request's 1024-token prefix and runs a 2 s cold prefill (L); the
    # new request costs 0.07 s there, behind what is left of L, or 1.07 s on idle replica 0.
    # Once L has run for 1 s the two first tokens are 0.03 s apart: slack alone takes replica
    # 0 (and spends 1.07 s of it); within a tolerance of 0.03 s or more the choices tie and
    # the one that spends less (the cache) wins. With 2 s of L ahead (waited_s 0) replica 0
    # is ahead by more than any tolerance here.
    def pick(tolerance_s):
        replicas, config, clock = tracked_cluster(2)
        slack = dispatcher("slack", replicas, config)
        send(replicas[1], config, Request.from_tokens("warm", 0.0, tokens(1024, 1100), 4))
        t = clock.t = replicas[1].pending(0.0)[0].work_s
        replicas[1].on_first_token("warm")
        replicas[1].on_end("warm")
        send(replicas[1], config, Request.from_tokens("L", t, tokens(0, 2048, 5), 4))
        now = clock.t = t + waited_s
        slack.tolerance_s = tolerance_s
        hit = Request.from_tokens("hit", now, tokens(1024, 1100, 1), 4)
        chosen = slack.pick(hit, now).replica_id
        return chosen, slack.predicted_first_token_s - now, slack.tie_broken

    assert pick(0.0) == (0, pytest.approx(1100 * TOKEN_S), False)
    if waited_s:
        assert pick(0.01)[::2] == (0, False)  # not a tie at this tolerance
        chosen, ttft, tied = pick(0.03)
        assert (chosen, tied) == (1, True)
        assert 1100 * TOKEN_S < ttft < 1100 * TOKEN_S + 0.05  # 31 ms later: a tie
    else:
        assert pick(1.0)[::2] == (0, False)


def test_slack_ties_a_prompt_no_cache_tells_apart_to_the_replica_it_sent_fewest():
    # idle replicas that both hold a shared 256-token prefix. Within a tolerance, a prompt the
    # caches cannot tell apart (none holds any of it, or all the same part) goes to the
    # replica slack sent fewest of its last picks, so new conversations spread; a turn of a
    # conversation one replica holds stays there. Slack alone (tolerance 0) takes the lower id.
    replicas, config, clock = tracked_cluster(2)
    for r, seed in ((0, 23), (1, 24)):
        req = Request.from_tokens(f"doc{r}", clock.t, tokens(256, 300, seed), 4)
        send(replicas[r], config, req)
        clock.t += replicas[r].pending(clock.t)[0].work_s
        replicas[r].on_first_token(req.request_id)
        replicas[r].on_end(req.request_id)
    slack = dispatcher("slack", replicas, config)
    shared = Request.from_tokens("shared", clock.t, tokens(256, 400, 41), 4)
    assert slack.pick(shared, clock.t).replica_id == 0
    slack = dispatcher("slack", replicas, config)  # no picks yet
    slack.tolerance_s = 0.05
    picks = []
    prompts = {
        "a": tokens(0, 1024, 20),  # fresh: a tie, both sent none: the best ranked, 0
        "a2": tokens(0, 1024, 20) + [5] * 60,  # its next turn: replica 0 holds it
        "shared": tokens(256, 400, 41),  # both hold 256: to 1, sent fewer
        "b": tokens(0, 300, 42),  # fresh: 0 was sent 2, 1 one
    }
    for rid, prompt in prompts.items():
        req = Request.from_tokens(rid, clock.t, prompt, 4)
        chosen = slack.pick(req, clock.t)
        picks.append((rid, chosen.replica_id, slack.tie_broken))
        send(chosen, config, req)
        clock.t += chosen.pending(clock.t)[0].work_s
        chosen.on_first_token(rid)
        chosen.on_end(rid)
    assert picks == [("a", 0, False), ("a2", 0, False), ("shared", 1, True), ("b", 1, True)]
    assert list(slack.recent_picks) == [0, 0, 1, 1]


def test_slack_keeps_a_waiting_request_within_its_deadline_rather_than_the_new_one_fastest():
    # replica 0 holds a short request with 0.3 s of its 0.5 s allowance left to wait; replica 1
    # holds a long prefill with plenty of slack. A new short request with an earlier deadline
    # on replica 0 would push the waiting one past its deadline; on replica 1 it goes first
    # and the long one keeps most of its slack (replicas running edf; a long prefill under way
    # yields to the policy's order, a short one would not).
    replicas, config, clock = tracked_cluster(2, policy="edf", long_prefill_threshold=4096)
    slack = dispatcher("slack", replicas, config)
    send(replicas[0], config, Request.from_tokens("s", 0.0, tokens(0, 400, 1), 4))
    send(replicas[1], config, Request.from_tokens("L", 0.0, tokens(0, 8000, 2), 4))
    clock.t = 0.01
    new = Request.from_tokens("n", 0.01, tokens(0, 200, 3), 4, ttft_deadline_s=0.3)
    assert slack.pick(new, 0.01).replica_id == 1
    lw = dispatcher("least_work", replicas, config)
    assert lw.pick(new, 0.01).replica_id == 0  # what least work would do


@pytest.mark.parametrize("name", ["round_robin", "least_work", "prefix", "slack"])
def test_one_dispatcher_picks_the_same_over_the_simulator_and_the_router(name):
    """The same arrivals, at the same times, to a simulated cluster and to the router's model
    of one: while no batch has run, both fronts see the same queues and caches."""
    sim = Simulator(
        ClusterConfig(replicas=2, dispatcher=name, kv_memory_gb=1.0),
        ParallelConfig(),
        SchedulerConfig.from_flat(iteration_budget_s=1 / 16),
        predictor=FixedCostPredictor(TOKEN_S),
    )
    sim_replicas = sim._replicas()
    sim_d = DISPATCHERS.get(name)(sim_replicas, sim.cluster, sim.scheduler_config)
    tracked, config, _ = tracked_cluster(2)
    route_d = dispatcher(name, tracked, config)
    lengths = [900, 64, 300, 2000, 128, 700, 50, 1200]
    for i, n in enumerate(lengths):
        a = Request.from_tokens(f"r{i}", 0.0, tokens(0, n, i), 8)
        b = Request.from_tokens(f"r{i}", 0.0, tokens(0, n, i), 8)
        s = sim_d.pick(a, 0.0)
        t = route_d.pick(b, 0.0)
        assert s.replica_id == t.replica_id, i
        s.add(a, 0.0)
        send(t, config, b, expected=8)
    for s, t in zip(sim_replicas, tracked):
        assert sorted(p.work_s for p in s.pending(0.0)) == pytest.approx(
            sorted(p.work_s for p in t.pending(0.0))
        )
        assert s.outstanding_work_s() == pytest.approx(t.outstanding_work_s())


def test_a_request_answered_whole_decodes_once_its_work_drains_and_is_no_speed_sample():
    # The router sees a whole answer's first token only at its end. Until then it is waiting
    # while its predicted work lasts, then decoding (first token unknown, presumed on time:
    # the replica's rule, replica_rules.on_time), and its end is no sample of the prefill.
    (r,), config, clock = tracked_cluster(1)
    whole = Request.from_tokens("whole", 0.0, tokens(0, 1024), 400)  # 1 s of prefill work
    r.on_dispatch(whole, 1.5, 400, streamed=False)
    assert [p.request_id for p in r.pending(0.5)] == ["whole"]
    clock.t = 2.0  # drained, and past its deadline: a decode, not a late prefill
    assert r.pending(2.0) == [] and r._decode_contexts() == [1024]
    send(r, config, Request.from_tokens("next", 2.0, tokens(0, 4096, 1), 4))
    assert r.step_budget_s(2.0) == config.iteration_budget_s  # it waits on the step
    clock.t = 9.0
    r.on_first_token("whole")  # the answer came, 9 s after it was sent
    assert r.slowdown == 1.0


def test_the_router_reads_the_targets_and_class_a_replica_reads():
    from medha.route.prompt import read_request

    def parsed(medha=None, headers=None):
        body = {"prompt": "x", **({"medha": medha} if medha is not None else {})}
        return read_request(body, [1, 2], "r", 0.0, headers or {}, 16).request

    r = parsed({"ttft_slo_s": 2.0, "tpot_slo_s": 0.05, "priority": "HIGH"})
    assert (r.ttft_deadline_s, r.tpot_target_s, r.priority_class) == (2.0, 0.05, "HIGH")
    # the replica answers 400 to a class it does not know: the router's model of it keeps the
    # default; llm-d's TPOT header reaches no replica, so it caps no step the router predicts
    r = parsed({"priority": "high"}, {"x-slo-ttft-ms": "300", "x-slo-tpot-ms": "20"})
    assert (r.ttft_deadline_s, r.tpot_target_s, r.priority_class) == (0.3, None, None)
