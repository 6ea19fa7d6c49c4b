import pytest

from medha.core.config import POLICY_NAMES
from medha.core.request import Request
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.policies import POLICIES, make_policy


def req(rid, arrival, deadline, total, remaining):
    r = Request(rid, arrival, 8, 1)
    r.deadline_s, r.total_work_s, r.remaining_work_s = deadline, total, remaining
    return r


def test_registry_lists_the_core_policies():
    assert {"fcfs", "edf", "lrs", "lars", "srpt"} <= set(POLICIES.names())


def test_the_config_knows_every_policy_and_no_other():
    # the config checks names against its list; the registry must implement exactly those
    assert POLICIES.names() == sorted(POLICY_NAMES)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="unknown policy 'fifo'.*lars"):
        make_policy("fifo")


def test_keys_follow_the_definitions():
    r = req("a", 1.0, 9.0, 4.0, 3.0)
    now = 2.0
    assert make_policy("fcfs").key(r, now) == 1.0
    assert make_policy("edf").key(r, now) == 9.0
    assert make_policy("lrs").key(r, now) == pytest.approx(9 - 2 - 3)
    assert make_policy("lars").key(r, now) == pytest.approx((9 - 2 - 3) / 4)  # w_total
    assert make_policy("srpt").key(r, now) == 3.0


def test_lars_and_edf_disagree_where_length_matters():
    # The paper's example at t=5: a long request half done (5 s left, deadline 16 s) and a
    # short one (0.5 s of work, deadline 1 s after its arrival at t=5).
    long_ = req("long", 0.0, 16.0, 10.0, 5.0)
    short = req("short", 5.0, 6.0, 0.5, 0.5)
    order = {
        p: sorted([long_, short], key=make_policy(p).sort_key(5.0))[0].request_id
        for p in ("fcfs", "edf", "lrs", "lars", "srpt")
    }
    assert order == {
        "fcfs": "long",
        "edf": "short",
        "lrs": "short",
        "lars": "long",  # rho 6/10 against 1.0 (per remaining work, 6/5: the short one first)
        "srpt": "short",
    }
    # Later, when the long one has burnt most of its slack, relative slack puts it first
    # while EDF still prefers any short request with an earlier deadline.
    short2 = req("short2", 12.5, 13.5, 0.5, 0.5)
    assert sorted([long_, short2], key=make_policy("lars").sort_key(12.5))[0] is long_
    assert sorted([long_, short2], key=make_policy("edf").sort_key(12.5))[0] is short2


def lars(per):
    return make_policy("lars", SchedulerConfig.from_flat(lars_slack=per))


def test_lars_key_follows_its_formula():
    # slack 9 - 2 - 3 = 4, over the 3 s of work left or the 4 s of the whole prefill
    r = req("a", 1.0, 9.0, 4.0, 3.0)
    assert lars("remaining").key(r, 2.0) == pytest.approx(4 / 3)
    assert lars("total").key(r, 2.0) == pytest.approx(4 / 4)
    assert make_policy("lars").key(r, 2.0) == lars(SchedulerConfig().lars.slack).key(r, 2.0)


def test_the_two_lars_formulas_order_the_papers_example_differently():
    # At t=5 r_L has run alone for 5 s: slack 16 - 5 - 5 = 6 s, so rho 6/5 = 1.2 over the work
    # left and 6/10 = 0.6 over its total; a short request just arrived has rho 0.5/0.5 = 1.0
    # either way. Per remaining work the short request goes first (as the paper's text says
    # it should); per total work (the paper's formula) r_L does, and keeps its rho while it
    # runs, until the short request's rho falls below 0.6, 0.2 s later.
    long_ = req("long", 0.0, 16.0, 10.0, 5.0)
    short = req("short", 5.0, 6.0, 0.5, 0.5)
    assert lars("remaining").key(long_, 5.0) == pytest.approx(1.2)
    assert lars("total").key(long_, 5.0) == pytest.approx(0.6)
    assert lars("remaining").key(short, 5.0) == lars("total").key(short, 5.0) == 1.0
    first = {
        per: sorted([long_, short], key=lars(per).sort_key(now))[0].request_id
        for per, now in (("remaining", 5.0), ("total", 5.0))
    }
    assert first == {"remaining": "short", "total": "long"}
    running = req("long", 0.0, 16.0, 10.0, 4.75)  # r_L at t=5.25, having run on
    assert lars("total").key(running, 5.25) == pytest.approx(0.6)
    assert sorted([running, short], key=lars("total").sort_key(5.25))[0] is short


def test_priority_over_lars_reads_the_same_formula():
    r = req("a", 1.0, 9.0, 4.0, 3.0)
    cfg = SchedulerConfig.from_flat(policy="priority", priority_base="lars", lars_slack="total")
    assert make_policy("priority", cfg).base.key(r, 2.0) == pytest.approx(1.0)
