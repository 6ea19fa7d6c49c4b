"""A replica's rules for its next step (who waits on the step and so its time budget, the prefill
order, what "long" and "under way" mean) read the same wherever they are applied: by the packer
and the scheduler of the replica itself, and by the router's model of that replica
(TrackedReplica), which supplies only its estimates of the queue.

Each case runs one ReplicaScheduler (the toy one: a token costs TOKEN_S) beside a
TrackedReplica that is sent the same requests at the same times and told what the router would
see: a streamed request's first token when the replica produces it, each request's end. At
the step under test the router's estimates of the work left are set to the replica's (the
router predicts them; here the question is the rules, not the prediction), and the time budget
the packer gives the step and the order in which it is handed the prefills are compared with
what the router's model says of the same instant."""

import dataclasses

import pytest
from conftest import toy_scheduler

from medha.core.batch import BatchResult
from medha.core.request import Request
from medha.route.tracked import TrackedReplica

BUDGET, WAIT, LONG = 1 / 16, 0.25, 1024


def tokens(n: int, seed: int, shared: list[int] = ()) -> list[int]:
    return list(shared) + [10_000 + seed * 7919 + i for i in range(n - len(shared))]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Twin:
    """A replica and the router's model of it, fed the same requests."""

    def __init__(self, **config) -> None:
        config = {
            "iteration_budget_s": BUDGET,
            "arrival_wait_s": WAIT,
            "long_prefill_threshold": LONG,
            **config,
        }
        self.sched = sched = toy_scheduler(**config)
        self.clock = Clock()
        self.tracked = TrackedReplica(
            0, sched.predictor, sched.config, sched.prefill_times, 16, 1 << 20, self.clock
        )
        self.now = 0.0
        self._streamed: dict[str, bool] = {}
        self._told_first: set[str] = set()
        self._seen: dict[str, int] = {}  # tokens the router has seen of each streamed request
        self._captured: dict = {}
        packer = sched.packer
        budget_of, pack = packer.batch_budget_s, packer.pack

        def batch_budget_s(builder, queue=()):
            self._captured["budget"] = budget = budget_of(builder, queue)
            return budget

        def capture_pack(now, queue, builder):
            ordered = queue.order() if hasattr(queue, "order") else queue  # (the scheduler's)
            self._captured["order"] = [r.request_id for r in ordered]
            return pack(now, queue, builder)

        packer.batch_budget_s, packer.pack = batch_budget_s, capture_pack

    def send(self, request: Request, streamed: bool = True) -> None:
        """`request` arrives at both (the router's copy is its own object, as parsed)."""
        self.now = max(self.now, request.arrival_s)
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(Request) if f.init}
        copy = Request(**fields)
        self.sched.add_request(request, request.arrival_s)
        self.clock.t = request.arrival_s
        self._streamed[request.request_id] = streamed
        self.tracked.on_dispatch(copy, request.deadline_s, request.max_tokens, streamed=streamed)

    def step(self) -> None:
        """One batch of the replica, and what the router sees of it."""
        self._captured.clear()
        batch = self.sched.schedule(self.now)
        assert batch is not None
        self.now += batch.predicted_time_s
        finished = self.sched.update(batch, BatchResult(batch.predicted_time_s), self.now)
        self.clock.t = self.now
        for r in self.sched.live_requests():
            self._tell_tokens(r)
        for r in finished:
            self._tell_tokens(r)
            self.tracked.on_end(r.request_id)

    def _tell_tokens(self, r: Request) -> None:
        """The router sees a streamed request's first token, then each token after it."""
        rid = r.request_id
        if r.first_token_s is not None and rid not in self._told_first:
            self._told_first.add(rid)
            if self._streamed[rid]:
                self.tracked.on_first_token(rid)
                self._seen[rid] = 1
        if rid in self._seen and len(r.token_times_s) > self._seen[rid]:
            self.tracked.on_tokens(rid, len(r.token_times_s) - self._seen[rid])
            self._seen[rid] = len(r.token_times_s)

    def run_until(self, t: float) -> None:
        while self.now < t:
            if not self.sched.has_unfinished():
                self.now = t
                break
            self.step()

    def compare(self) -> tuple[float, list[str], float, list[str]]:
        """(the packer's budget, the order it was handed the prefills; the router's model's
        budget and order) at the replica's next step, which then runs."""
        now = self.now
        self.clock.t = now
        self.tracked.pending(now)  # the router's model catches up to now ...
        for rid, routed in self.tracked._live.items():  # ... with the replica's work left
            r = self.sched.get(rid)
            if routed.first_token_s is None and r is not None:
                routed.work_s = r.remaining_work_s
        router = (self.tracked.step_budget_s(now), self.tracked.waiting_order(now))
        self.step()
        return self._captured["budget"], self._captured["order"], *router


def assert_same(twin: Twin) -> tuple[float, list[str]]:
    budget, order, router_budget, router_order = twin.compare()
    assert (router_budget, router_order) == (pytest.approx(budget), order), (
        f"packer: budget {budget:.4f} s, order {order}; "
        f"router's model: budget {router_budget:.4f} s, order {router_order}"
    )
    return budget, order


def test_a_prefix_hit_makes_a_long_prompt_short():
    """The replica calls a request long by the tokens its prefix cache does not hold: a hit on
    most of a long prompt leaves a short prefill, under way once it started."""
    twin = Twin(prefix_cache="device")
    a = tokens(4096, 1)
    twin.send(Request.from_tokens("A", 0.0, a, 1))
    twin.run_until(10.0)
    assert not twin.sched.has_unfinished()
    twin.send(Request.from_tokens("B", 10.0, tokens(4096, 2, shared=a[:3584]), 4))
    twin.send(Request.from_tokens("C", 10.0, tokens(4096, 3), 4))
    twin.step()  # B is looked up: 3584 tokens cached, 512 to prefill
    b = twin.sched.get("B")
    assert b.num_cached_tokens == 3584 and b.started
    budget, order = assert_same(twin)
    assert budget == BUDGET and order[0] == "B"


def test_a_decode_before_its_first_token_reached_the_router():
    """A request answered whole (not streamed) decodes on the replica while the router has
    seen no first token: it is on time (a decode waits on every step), not a late prefill."""
    twin = Twin()
    twin.send(Request.from_tokens("D", 0.0, tokens(64, 4), 2000, ttft_deadline_s=0.5), False)
    twin.run_until(1.0)
    assert twin.sched.get("D").first_token_s < 0.5
    twin.send(Request.from_tokens("L", 1.0, tokens(4096, 5), 4))
    budget, order = assert_same(twin)
    assert budget == BUDGET and order == ["L"]


def test_a_decode_that_banked_time_lets_a_long_prefill_run_to_the_arrival_wait():
    """A TPOT target of its own is a mean over the answer: a decode whose tokens came far
    faster than 0.05 s each has banked the difference, and with nobody else waiting the step
    runs to the arrival wait, as with nobody decoding. A decode with no target of its own
    waits on every step: the budget. The router's model counts the bank from the tokens it
    saw."""
    twin = Twin()
    twin.send(Request.from_tokens("T", 0.0, tokens(64, 19), 2000, tpot_target_s=0.05))
    twin.run_until(0.5)
    t = twin.sched.get("T")
    assert t.own_due_s() - 0.5 > WAIT  # ~470 tokens in 0.5 s: 23 s banked
    twin.send(Request.from_tokens("L", 0.5, tokens(4096, 20), 4))
    budget, _ = assert_same(twin)
    assert budget == WAIT
    twin.send(Request.from_tokens("U", twin.now, tokens(64, 21), 2000))
    twin.run_until(twin.now + 0.2)
    assert twin.sched.get("U").first_token_s is not None
    budget, _ = assert_same(twin)
    assert budget == BUDGET


def test_a_decode_behind_its_target_gets_the_shortest_step():
    """Behind its mean (its first token late in a slow step), a decode with its own target gets
    steps of the decodes and one --min-chunk-tokens chunk until it catches up."""
    twin = Twin()
    twin.send(Request.from_tokens("L", 0.0, tokens(4096, 22), 4))
    twin.send(Request.from_tokens("T", 0.0, tokens(1000, 23), 2000, tpot_target_s=0.002))
    t = twin.sched.get("T")
    while len(t.token_times_s) < 3:
        twin.step()
    assert t.own_due_s() < twin.now
    budget, _ = assert_same(twin)
    assert budget == pytest.approx((1 + twin.sched.config.min_chunk_tokens) / 1024)


@pytest.mark.parametrize("overload_steps", [True, False])
def test_a_prefill_with_its_own_deadline_waits_on_its_latest_start(overload_steps):
    """Beside other prefills, a short one with a TTFT deadline of its own (the API's
    ttft_slo_s) waits on the step only until its latest start (its deadline less its work
    left): the step runs past the budget toward the arrival wait, where one without a deadline
    of its own holds it to the budget. One whose latest start has passed waits on no step under
    overload, and on the budget without it."""
    twin = Twin(overload_steps=overload_steps)
    # 256 tokens each (0.25 s of work): latest starts at 0.125 s and 0.75 s
    twin.send(Request.from_tokens("A", 0.0, tokens(256, 30), 4, ttft_deadline_s=0.375))
    twin.send(Request.from_tokens("B", 0.0, tokens(256, 31), 4, ttft_deadline_s=1.0))
    budget, order = assert_same(twin)
    assert BUDGET < budget == 0.125 < WAIT and order == ["A", "B"]
    twin.send(Request.from_tokens("U", twin.now, tokens(256, 32), 4))  # its deadline the default
    budget, _ = assert_same(twin)
    assert budget == BUDGET
    twin = Twin(overload_steps=overload_steps)
    twin.send(Request.from_tokens("C", 0.0, tokens(256, 33), 4, ttft_deadline_s=0.125))
    twin.send(Request.from_tokens("D", 0.0, tokens(256, 34), 4, ttft_deadline_s=1.0))
    budget, _ = assert_same(twin)  # (C cannot make its deadline, by the prediction)
    assert budget == (WAIT if overload_steps else BUDGET)


@pytest.mark.parametrize("overload_steps", [True, False])
def test_late_requests_wait_on_no_step_under_overload(overload_steps):
    """Past its deadline a request waits on nothing a step could save: with a late decode, a
    late short prefill and a long one, the step runs to the arrival wait. With the overload
    steps off (`--no-overload-steps`) the late ones wait on it like any other: the budget."""
    twin = Twin(overload_steps=overload_steps)
    twin.send(Request.from_tokens("R", 0.0, tokens(64, 8), 2000, ttft_deadline_s=0.05))
    twin.send(Request.from_tokens("L", 0.0, tokens(4096, 9), 4, ttft_deadline_s=20.0))
    twin.run_until(0.2)
    twin.send(Request.from_tokens("S", 0.2, tokens(512, 10), 4, ttft_deadline_s=0.1))
    twin.run_until(0.5)  # S's deadline passed before its first chunk (at 0.3125)
    s = twin.sched.get("S")
    assert s.started and s.first_token_s is None and s.deadline_s < twin.now
    assert twin.sched.get("R").first_token_s > twin.sched.get("R").deadline_s
    budget, order = assert_same(twin)
    assert budget == (WAIT if overload_steps else BUDGET) and order == ["S", "L"]


def test_ties_in_the_policys_key_keep_the_queue_order():
    twin = Twin(policy="fcfs")
    for rid in ("b", "a"):  # b admitted first; the same arrival
        twin.send(Request.from_tokens(rid, 0.0, tokens(256, ord(rid)), 4))
    _, order = assert_same(twin)
    assert order == ["b", "a"]


def test_a_class_policy_orders_by_class_first():
    twin = Twin(policy="priority")
    twin.send(Request.from_tokens("n", 0.0, tokens(256, 11), 4, ttft_deadline_s=1.0))
    high = Request.from_tokens("h", 0.0, tokens(256, 12), 4, ttft_deadline_s=5.0)
    high.priority_class = "HIGH"
    twin.send(high)
    _, order = assert_same(twin)
    assert order == ["h", "n"]


def test_all_of_it_in_one_queue():
    """A prefix hit on a long prompt, a decode whose first token the router has not seen, a
    decode behind its own TPOT target and a late one, in one snapshot."""
    twin = Twin(prefix_cache="device")
    a = tokens(4096, 13)
    twin.send(Request.from_tokens("A", 0.0, a, 1))
    twin.run_until(10.0)
    twin.send(Request.from_tokens("D", 10.0, tokens(64, 14), 2000, ttft_deadline_s=0.5), False)
    twin.send(Request.from_tokens("T", 10.0, tokens(64, 15), 2000, tpot_target_s=0.0005))
    twin.send(Request.from_tokens("R", 10.0, tokens(64, 16), 2000, ttft_deadline_s=0.01))
    twin.run_until(10.5)
    twin.send(Request.from_tokens("B", 10.5, tokens(4096, 17, shared=a[:3584]), 4))
    twin.send(Request.from_tokens("C", 10.5, tokens(4096, 18), 4))
    twin.step()
    assert twin.sched.get("R").first_token_s > twin.sched.get("R").deadline_s
    assert twin.sched.get("B").num_cached_tokens == 3584 or twin.sched.get("C").started
    budget, _ = assert_same(twin)
    assert budget < BUDGET  # T, behind its target (a token takes 1 ms), caps it
