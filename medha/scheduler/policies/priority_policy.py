"""Priority classes: REALTIME > HIGH > NORMAL > LOW, then another policy within a class.

A request's class (`Request.priority_class`, the server's `"medha": {"priority": ...}`; none
is NORMAL) comes before anything the base policy (`--priority-base`, fcfs by default) looks at.
The scheduler also ranks preemption victims by class first: under memory pressure a LOW
decode is preempted before a HIGH one, and a new REALTIME prompt may preempt LOW decodes to
start, where under the other policies a prefill never evicts a running decode.

SLO-risk preemption (`slo_risk_victims`, after the article on Orca/Sarathi scheduling, seed 001):
when a REALTIME or HIGH decode's next token is predicted to come within 15 ms of its TPOT
target, running NORMAL and LOW decodes are preempted (LOW first, then those with the fewest
tokens generated: the least work lost) until its slack is back above 30 ms. While that leaves no
room, preempted NORMAL and LOW requests stay swapped out and new ones do not start, so they do
not come back only to be preempted again.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from medha.core.request import PRIORITY_CLASSES, Request
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.policies.base_policy import (
    POLICIES,
    Policy,
    SortKey,
    StepTime,
    make_policy,
)

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.scheduler.block_manager import BlockManager


@POLICIES.register("priority")
class PriorityPolicy(Policy):
    summary = (
        "priority classes REALTIME > HIGH > NORMAL > LOW, then --priority-base "
        "(fcfs) within a class; lower classes are preempted first"
    )

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.base = make_policy(self.config.priority.base, self.config)
        # SLO-risk preemption's verdict at the last batch: how many NORMAL or LOW requests may
        # swap back in (None: any number), and whether new ones may start their prefill.
        self._swap_room: int | None = None
        self._holding = False

    def follow(self, config: SchedulerConfig) -> None:
        super().follow(config)
        self.base.follow(config)

    def sort_key(self, now: float) -> SortKey:
        key = self.base.sort_key(now)
        return lambda r: (r.priority_rank, key(r))

    # ---- the questions the scheduler and the KV arbiter ask: answered by class first ------
    def order_prefills(
        self, first: list[Request], rest: list[Request], now: float
    ) -> list[Request]:
        """By class, then `first` ahead of `rest`, then the key: the scheduler's rule applies
        within a class, never across."""
        key = self.sort_key(now)
        tagged = [(r, False) for r in first] + [(r, True) for r in rest]
        tagged.sort(key=lambda t: (t[0].priority_rank, t[1], key(t[0])))
        return [r for r, _ in tagged]

    def eviction_rank(self, now: float) -> Callable[[Request], tuple]:
        """By class before anything else: a LOW decode goes before a HIGH prefill. Within a
        class as the base policy ranks (started prefills in admission order)."""
        within = super().eviction_rank(now)
        return lambda r: (r.priority_rank, *within(r))

    def may_evict_decodes(self, r: Request) -> bool:
        """Any request may evict a decode ranked below it: the class ranks alone keep a
        prefill off the decodes of its own class and of more urgent ones."""
        return True

    def urgent_prefill(self, queue: Iterable[Request], now: float) -> Request | None:
        """The first prefill in policy order with work left to schedule: it may preempt running
        decodes (and prefills) of less urgent classes."""
        pending = [r for r in queue if r.num_scheduled < r.num_tokens]
        return min(pending, key=self.sort_key(now)) if pending else None

    def starts_before_swapped(self, r: Request, swapped: Iterable[Request]) -> bool:
        """A prefill of a more urgent class than every swapped request starts first."""
        return r.priority_rank < min(s.priority_rank for s in swapped)

    def swap_in_order(self, swapped: list[Request], urgent: Request | None) -> list[Request]:
        """Most urgent class first (swap-out order within a class), and none of a less urgent
        class than the urgent prefill waiting (it would only be evicted again), nor more NORMAL
        and LOW ones than SLO-risk preemption left room for."""
        swapped.sort(key=lambda r: r.priority_rank)  # stable: swap-out order in a class
        if urgent is not None:
            swapped = [r for r in swapped if r.priority_rank <= urgent.priority_rank]
        room = self._swap_room
        if room is not None:
            guarded = [r for r in swapped if r.priority_rank <= _GUARDED]
            swapped = guarded + [r for r in swapped if r.priority_rank > _GUARDED][:room]
        return swapped

    def slo_risk_victims(
        self,
        decodes: list[Request],
        swapped: Iterable[Request],
        step_time: StepTime,
        now: float,
    ) -> list[Request]:
        """The article's rule, projected one step ahead. A REALTIME or HIGH decode's TBT slack
        is its TPOT target (its own, else the scheduler's) minus the time since its last token
        minus the predicted next step; the article measures only the time since the last token,
        which no preemption can change, so its loop would preempt every candidate. Preempting
        a decode shortens the next step by what its context costs to read, which is what
        brings the slack back. Prefill-phase requests are not victims: the packer fits their
        chunks into what the tightest TPOT target among the batch's decodes leaves.

        A decode whose next token is late already whatever happens (its target passed since
        its last token) is not protected: no preemption can save that token, and the rule
        would shed every candidate for it."""
        settings = self.config.priority
        holding, self._swap_room, self._holding = self._holding, None, False
        if not settings.slo_risk:
            return []
        target = self.config.tpot_target_s
        left = [
            (r.tpot_target_s or target) - (now - r.token_times_s[-1])
            for r in decodes
            if r.priority_rank <= _GUARDED and r.token_times_s
        ]
        left = [t for t in left if t > 0]
        if not left:
            return []
        headroom = min(left)  # the tightest protected decode's time until its next token is late

        def slack(kv_lens: list[int]) -> float:
            return headroom - step_time(kv_lens)

        kept = [r for r in decodes if r.priority_rank <= _GUARDED]
        candidates = sorted(
            (r for r in decodes if r.priority_rank > _GUARDED),
            key=lambda r: (-r.priority_rank, len(r.output_token_ids), r.admission_seq),
        )
        kept_lens = [r.num_scheduled for r in kept]
        lens = [r.num_scheduled for r in candidates]  # shed from the front
        victims: list[Request] = []
        if slack(kept_lens + lens) < settings.slo_risk_slack_s:
            holding = True
            # The fewest candidates, in victim order, whose preemption restores the resume
            # slack (all of them if none suffices): the slack only grows as decodes leave.
            shed = bisect_left(
                range(len(candidates)),
                True,
                key=lambda k: slack(kept_lens + lens[k:]) > settings.slo_risk_resume_s,
            )
            victims, lens = candidates[:shed], lens[shed:]
        if victims:
            self._swap_room, self._holding = 0, True  # none back in the batch that sheds
            return victims
        if not holding:
            return victims
        # Since a decode was last at risk: room for swapped NORMAL and LOW requests to come back
        # (in swap-in order) without leaving less than the resume slack; none for new ones
        # until all of them fit.
        back = self.swap_in_order(list(swapped), None)  # REALTIME and HIGH first: always back
        back_lens = [r.num_scheduled for r in back]
        base = kept_lens + lens
        resume = settings.slo_risk_resume_s
        fits = bisect_left(
            range(len(back)), True, key=lambda m: slack(base + back_lens[: m + 1]) < resume
        )
        self._swap_room = max(0, fits - sum(r.priority_rank <= _GUARDED for r in back))
        self._holding = fits < len(back) or slack(base) < resume
        return victims

    def admit(
        self, queue: list[Request], is_live: Callable[[str], bool], now: float
    ) -> list[Request]:
        """The base policy's, except that while SLO-risk preemption leaves no room, NORMAL and
        LOW prefills not yet under way wait (they would join the decodes it just shed)."""
        admitted = self.base.admit(queue, is_live, now)
        if not self._holding:
            return admitted
        return [r for r in admitted if r.priority_rank <= _GUARDED or r.num_scheduled]

    # decode selection is the base policy's

    def wake_at(self) -> float | None:
        return self.base.wake_at()

    def bind(self, predictor: Predictor, blocks: BlockManager, max_model_len: int) -> None:
        self.base.bind(predictor, blocks, max_model_len)

    def select_decodes(self, decodes: list[Request], now: float) -> list[Request]:
        return self.base.select_decodes(decodes, now)


# REALTIME and HIGH decodes are protected by SLO-risk preemption; NORMAL and LOW are its victims.
_GUARDED = PRIORITY_CLASSES.index("HIGH")
