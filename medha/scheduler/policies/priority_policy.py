"""Priority classes: REALTIME > HIGH > NORMAL > LOW, then another policy within a class.

A request's class (`Request.priority_class`, the server's `"medha": {"priority": ...}`; none
is NORMAL) comes before anything the base policy (`--priority-base`, fcfs by default) looks at.
The scheduler also ranks preemption victims by class first: under memory pressure a LOW
decode is preempted before a HIGH one, and a new REALTIME prompt may preempt LOW decodes to
start, where under the other policies a prefill never evicts a running decode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from medha.core.config import SchedulerConfig
from medha.core.request import Request
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
    uses_classes = True

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.base = make_policy(self.config.priority_base, self.config)

    def sort_key(self, now: float) -> SortKey:
        key = self.base.sort_key(now)
        return lambda r: (r.priority_rank, key(r))

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
