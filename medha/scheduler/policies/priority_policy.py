"""Priority classes: REALTIME > HIGH > NORMAL > LOW, then another policy within a class.

A request's class (`Request.priority_class`, the server's `"medha": {"priority": ...}`; none
is NORMAL) comes before anything the base policy (`--priority-base`, fcfs by default) looks at.
The scheduler also ranks preemption victims by class first: under memory pressure a LOW
decode is preempted before a HIGH one, and a new REALTIME prompt may preempt LOW decodes to
start, where under the other policies a prefill never evicts a running decode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from medha.core.config import SchedulerConfig
from medha.core.request import Request, RequestState
from medha.scheduler.policies.base_policy import POLICIES, Policy, SortKey, make_policy

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
        """By class before anything else: a LOW decode goes before a HIGH prefill."""
        key = self.sort_key(now)
        decoding = RequestState.DECODING
        return lambda r: (
            (r.priority_rank, 0, r.arrival_s, r.admission_seq)
            if r.state is decoding
            else (r.priority_rank, 1, key(r), r.admission_seq)
        )

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
        class than the urgent prefill waiting (it would only be evicted again)."""
        swapped.sort(key=lambda r: r.priority_rank)  # stable: swap-out order in a class
        if urgent is None:
            return swapped
        return [r for r in swapped if r.priority_rank <= urgent.priority_rank]

    # admission and decode selection are the base policy's
    def admit(
        self, queue: list[Request], is_live: Callable[[str], bool], now: float
    ) -> list[Request]:
        return self.base.admit(queue, is_live, now)

    def wake_at(self) -> float | None:
        return self.base.wake_at()

    def bind(self, predictor: Predictor, blocks: BlockManager, max_model_len: int) -> None:
        self.base.bind(predictor, blocks, max_model_len)

    def select_decodes(self, decodes: list[Request], now: float) -> list[Request]:
        return self.base.select_decodes(decodes, now)
