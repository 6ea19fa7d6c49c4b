"""Who goes first: a policy maps each waiting request to a priority key (lower runs first).

A policy may also hold requests back (`admit`): the deferred-prefill policy lets new prefills
start only in groups. The scheduler passes it every prefill-phase request each iteration.
Likewise `select_decodes` picks which ready decodes run this iteration (all of them by
default): the AlignedServe policy runs decodes of similar prefix length together. A policy that
holds prefills back to batch them later (PLA-Serve) says when through `wake_at`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from medha.core.config import SchedulerConfig
from medha.core.request import Request, RequestState
from medha.utils.registry import Registry

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.scheduler.block_manager import BlockManager

SortKey = Callable[[Request], float]


class Policy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    # True: requests are ranked by priority class before anything else, in the queue and when
    # the scheduler picks whom to preempt (a prefill may then evict a lower class's decode)
    uses_classes: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()

    def admit(
        self, queue: list[Request], is_live: Callable[[str], bool], now: float
    ) -> list[Request]:
        """The prefill-phase requests that may be scheduled now (default: all of them).
        `is_live(request_id)` says whether a request is still in the scheduler."""
        return queue

    def wake_at(self) -> float | None:
        """When prefills that the last `admit` held back will be let go if nothing else
        happens (None: none held). An idle executor must call `schedule` again then, or a
        policy that waits to batch (PLA-Serve's window) would never be asked again."""
        return None

    def bind(self, predictor: Predictor, blocks: BlockManager, max_model_len: int) -> None:
        """Called once by the scheduler that owns this policy (a policy that forms decode
        batches needs the cost model and the KV cache's size)."""
        return None

    def select_decodes(self, decodes: list[Request], now: float) -> list[Request]:
        """The ready decodes (none in a running batch) that join this iteration: all of them by
        default, as in continuous batching. Must not return an empty list for a non-empty one,
        or an iteration with no prefill work would run nothing."""
        return decodes

    @abstractmethod
    def sort_key(self, now: float) -> SortKey:
        """A key function for `sorted`, valid at time `now`."""

    def key(self, request: Request, now: float) -> float:
        return self.sort_key(now)(request)

    def eviction_rank(self, now: float) -> Callable[[Request], tuple]:
        """Who keeps its KV when blocks run short: lower ranks are kept longer. Running decodes
        outrank every prefill (evicting one throws away admitted work and stalls its token
        stream); among decodes the newest goes first, as in vLLM; among prefills the policy's
        key decides. A class policy ranks by class before all that: a LOW decode goes before a
        HIGH prefill. Admission order breaks ties, so the rank is a total order."""
        key = self.sort_key(now)
        decoding = RequestState.DECODING
        if self.uses_classes:
            return lambda r: (
                (r.priority_rank, 0, r.arrival_s, r.admission_seq)
                if r.state is decoding
                else (r.priority_rank, 1, key(r), r.admission_seq)
            )
        return lambda r: (
            (0, r.arrival_s, r.admission_seq)
            if r.state is decoding
            else (1, key(r), r.admission_seq)
        )


POLICIES: Registry[Policy] = Registry("policy", __package__, suffix="_policy")


def make_policy(name: str, config: SchedulerConfig | None = None) -> Policy:
    return POLICIES.get(name)(config)
