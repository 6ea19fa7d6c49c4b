"""A replica's rules for its next step, in one place: who is long, which prefill is under way,
who waits on the step (and so the step's time budget), and the order the prefills are served in.

Three fronts apply them to a replica's queue: the replica itself (the packer sizes its step by
`step_budget_s`, ReplicaScheduler orders its prefills by `prefill_order`), the simulator's
replicas as the dispatchers see them, and the router's model of a real replica
(medha/route/tracked.py). Each hands the rules a `QueueSnapshot` of the requests as it knows
them: the replica its Requests, the router its estimates (the work left, the first tokens it
has seen, the prefix it expects cached). The rules read nothing else, so the router predicts
the step the replica runs by the same code that runs it.

What a rule reads of a waiting request is what a Request has (`Waiting`); the dispatchers' view
of one (`medha.dispatch.Pending`) has the same names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from medha.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from medha.scheduler.policies.base_policy import Policy


class Waiting(Protocol):
    """A request waiting for its first token, as the rules read it (a Request is one). A
    policy's key reads more of it: its arrival, work whole (LARS's relative slack), its
    priority class."""

    deadline_s: float
    ttft_deadline_s: float | None  # its own TTFT deadline (the API's ttft_slo_s), if it set one

    def slack(self, now: float) -> float:
        """Its deadline less now and its predicted prefill work still ahead (Request.slack)."""

    @property
    def num_uncached_tokens(self) -> int:
        """Context tokens the prefix cache does not supply, as of its latest look-up (none
        before its prefill starts: a request is looked up just before its first chunk)."""

    @property
    def started(self) -> bool:
        """Whether a chunk of its (re)started prefill has been scheduled."""


class Decoding(Protocol):
    """A request past its prefill, decoding."""

    deadline_s: float
    tpot_target_s: float | None  # its own TPOT target (the API's tpot_slo_s), if it set one

    @property
    def first_token_s(self) -> float | None:
        """When its first token came (None: not known, as the router's model has it of a
        request it sees no stream of)."""

    def own_due_s(self, spp: int = 1) -> float | None:
        """When its next token falls due by its own TPOT target, a mean over its answer
        (Request.own_due_s); None if it set none (or, for the router, the first token is not
        known)."""


W = TypeVar("W", bound=Waiting)


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """A replica's queue at `now`, by reference (the simulator takes one every step)."""

    now: float
    waiting: Collection[Waiting]  # prefill-phase requests the step may serve, in queue order
    decoding: Iterable[Decoding]  # decoding, in this step or in one still running
    # whether a request may carry its own target, a TTFT deadline or a TPOT target (the API's
    # ttft_slo_s, tpot_slo_s); else none is asked
    told: bool = False


@dataclass(frozen=True, slots=True)
class StepRules:
    """The settings the rules read, from a replica's resolved config."""

    long_threshold: int
    iteration_budget_s: float
    arrival_wait_s: float
    min_chunk_tokens: int
    spp: int
    overload_steps: bool  # a late request waits on no step (nobody_waits)

    @classmethod
    def of(cls, config: SchedulerConfig, spp: int) -> StepRules:
        return cls(
            config.long_prefill_threshold,
            config.iteration_budget_s,
            config.arrival_wait_s,
            config.min_chunk_tokens,
            spp,
            config.overload_steps,
        )


def is_long(r: Waiting, threshold: int) -> bool:
    """A long prefill, by the work left to plan: a prompt mostly served from the prefix cache is
    not one. A long prefill waits for its whole prefill, not a step; LARS never serves it early
    and space sharing gives it a share of the step."""
    return r.num_uncached_tokens >= threshold


def under_way(r: Waiting, threshold: int) -> bool:
    """A short prefill that has started, which the replica finishes before any other."""
    return r.started and not is_long(r, threshold)


def on_time(d: Decoding) -> bool:
    """Whether a decoding request had its first token by its deadline (or may have: a first
    token not known is presumed on time). Only those can still meet their SLO, and so wait on
    the length of every step."""
    first = d.first_token_s
    return first is None or first <= d.deadline_s


def nobody_waits(q: QueueSnapshot, rules: StepRules) -> bool:
    """Whether nobody waits on this step's end but requests with targets of their own
    (`told_due_s` bounds the step for them): nothing else decodes on time and the queue holds
    one prefill alone, or long ones, late ones and told ones only (a long prefill waits for
    its whole prefill; a late one, past its TTFT deadline, for nothing a step could save, and
    with `overload_steps` off waits like any other; a told one, with its own TTFT deadline,
    for the latest start that deadline leaves it). Read from the queue's shape and, once
    deadlines have passed, the deadlines: while every deadline is ahead of both clocks the
    simulator, given the engine's requests, makes the engine's decisions
    (analysis/schedule_match.py)."""
    if rules.arrival_wait_s <= rules.iteration_budget_s:
        return False  # the cheap exit first: the step is the budget either way
    late = rules.overload_steps  # a late request waits on no step (off: on every step)
    told = q.told  # (a request with its own target waits on told_due_s instead)
    if any(
        (not late or on_time(d)) and not (told and d.tpot_target_s is not None) for d in q.decoding
    ):
        return False
    if len(q.waiting) <= 1:
        return True
    long, now = rules.long_threshold, q.now
    return all(
        is_long(r, long)
        or (late and r.deadline_s < now)
        or (told and r.ttft_deadline_s is not None)
        for r in q.waiting
    )


def told_due_s(q: QueueSnapshot, rules: StepRules) -> float | None:
    """The earliest the step must end for a request with a target of its own that waits on it
    (on time, or any with `overload_steps` off); None if none set one:

    - a decode: when its next token falls due by its own TPOT target (`Decoding.own_due_s`);
    - a prefill beside others with its own TTFT deadline: its latest start, the deadline less
      its predicted work left (now plus its slack): a step that ends by then, whatever it
      served, leaves it time to make its deadline, and a longer one pays each step's fixed
      cost fewer times for everyone behind it (issue 69: a burst of mid-size prompts drained
      at half vLLM's rate in reading-pace steps on a CPU). One whose latest start has passed
      is late for this purpose: no step can save its deadline by the prediction. A prefill
      alone is the step's own work, as in `nobody_waits`."""
    if not q.told:
        return None
    late, now = rules.overload_steps, q.now
    dues = [
        due
        for d in q.decoding
        if (not late or on_time(d)) and (due := d.own_due_s(rules.spp)) is not None
    ]
    if len(q.waiting) > 1:
        least = rules.iteration_budget_s  # (what a short prefill gets without a deadline)
        dues += [
            now + max(slack, least)
            for r in q.waiting
            if r.ttft_deadline_s is not None and ((slack := r.slack(now)) >= 0 or not late)
        ]
    return min(dues, default=None)


def step_budget_s(q: QueueSnapshot, rules: StepRules, floor_s: Callable[[], float]) -> float:
    """The time budget of the step, from who waits for it to end:

    - decodes (their next token): the iteration budget, a reading pace on every gap;
    - short prefills beside others (their first token, or their turn): the iteration budget,
      or with TTFT deadlines of their own (the API's ttft_slo_s), their latest start, below;
    - nobody (`nobody_waits`): the arrival wait, the longest a request arriving during the step
      may wait, so that a long prefill alone runs in few large chunks (docs/design.md, "The
      iteration budget"). Under overload, when every request has missed its TTFT deadline,
      steps run to the arrival wait too: that buys throughput (the queue drains sooner) where
      small steps buy nobody's SLO;
    - decodes with TPOT targets of their own (the API's tpot_slo_s), a mean over the answer:
      until the first of their next tokens falls due (`told_due_s`), within whichever of the
      above holds for everyone else. A decode whose tokens came faster than its target has
      banked the difference, and the step spends it on a larger chunk of a long prompt, as
      vLLM's token-budget steps do with every decode and no target (issue 69: each step less
      saves its fixed cost, 25-45 ms on a CPU); one behind its target gets short steps until
      it catches up. A prefill with a TTFT deadline of its own waits until its latest start,
      its deadline less its work left, and never asks for less than the budget. Never below
      `floor_s()` (within the iteration budget), the step's decodes plus one fresh
      --min-chunk-tokens prefill chunk (a request still in prefill is judged by its TTFT, not
      its TPOT): one client asking for token times the hardware cannot give would otherwise
      hold every newcomer at zero progress until it finished."""
    budget = rules.arrival_wait_s if nobody_waits(q, rules) else rules.iteration_budget_s
    due = told_due_s(q, rules)
    if due is None:
        return budget
    return max(min(budget, due - q.now), min(floor_s(), rules.iteration_budget_s))


def prefill_order(policy: Policy, queue: Iterable[W], now: float, threshold: int) -> list[W]:
    """`queue` (in the replica's queue order) in the order the replica serves it: the policy's
    (`Policy.order_prefills`: its key, ties in queue order; a class policy by class first; LARS
    moves short prefills up where no one misses for them), except that a short prefill already
    under way goes first (within its class, under a class policy).

    Slack-based keys rise as a request is served (its remaining work shrinks while its slack
    stays), so without that exception short prefills would take turns, each finishing just
    before its deadline instead of one after the other. Long prefills stay in policy order:
    their share is what space sharing and LARS arbitrate."""
    first: list[W] = []
    rest: list[W] = []
    for r in queue:
        (first if under_way(r, threshold) else rest).append(r)
    return policy.order_prefills(first, rest, now)
