"""Who goes first: a policy maps each waiting request to a priority key (lower runs first).

A policy may also hold requests back (`admit`): the deferred-prefill policy lets new prefills
start only in groups. The scheduler passes it every prefill-phase request each iteration.
Likewise `select_decodes` picks which ready decodes run this iteration (all of them by
default): the AlignedServe policy runs decodes of similar prefix length together. A policy that
holds prefills back to batch them later (PLA-Serve) says when through `wake_at`.

The scheduler and the KV arbiter ask the policy whatever depends on it: the order of prefills
and of swap-ins, whom to evict first (`eviction_rank`), whether a prefill may evict running
decodes or start before swapped requests come back, and which prefill may make room for itself
first (`urgent_prefill`). The defaults are those of a policy without priority classes; the
`priority` policy answers by class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

from medha.core.request import Request, RequestState
from medha.utils.registry import Registry

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.scheduler.block_manager import BlockManager
    from medha.scheduler.config import SchedulerConfig

SortKey = Callable[[Request], float]
StepTime = Callable[[list[int]], float]


class Policy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    # whether its batches are the packer's alone, so that an executor may pause a step of long
    # prefills for whoever waits (SchedulerConfig.pause_steps): not a policy that holds
    # prefills back on purpose (deferred, pla) or runs a chosen subset of the decodes (aligned)
    pauses_steps: ClassVar[bool] = True

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        if config is None:
            # (here, not at the top: SchedulerConfig's module imports the policies' settings,
            # whose package's __init__ imports this module)
            from medha.scheduler.config import SchedulerConfig

            config = SchedulerConfig()
        self.config = config

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

    def follow(self, config: SchedulerConfig) -> None:
        """The owning scheduler's defaults, resolved again from its corrected model
        (ReplicaScheduler._apply): the policy reads them from now on."""
        self.config = config

    def bind_prefix_cache(self, peek_cached: Callable[[Request], int]) -> None:
        """Called once by the scheduler with its prefix cache's look-up (prompt tokens the
        cache holds for a request now, nothing taken), for a policy that classes requests by
        their uncached work (PLA-Serve's re-prefills)."""
        return None

    def select_decodes(self, decodes: list[Request], now: float) -> list[Request]:
        """The ready decodes (none in a running batch) that join this iteration: all of them by
        default, as in continuous batching. Must not return an empty list for a non-empty one,
        or an iteration with no prefill work would run nothing."""
        return decodes

    def kv_move_time_s(self) -> float:
        """Seconds that KV moves of the policy's own, made for the decodes it last selected,
        add to that iteration (AlignedServe moves its running batch in and out of a host pool);
        read once per batch. None by default."""
        return 0.0

    @abstractmethod
    def sort_key(self, now: float) -> SortKey:
        """A key function for `sorted`, valid at time `now`."""

    def key(self, request: Request, now: float) -> float:
        return self.sort_key(now)(request)

    def order_prefills(
        self, first: list[Request], rest: list[Request], now: float
    ) -> list[Request]:
        """The prefill queue in this policy's order, `first` (the scheduler's: short prefills
        already under way) ahead of `rest`. Each list keeps the order it came in among equal
        keys."""
        key = self.sort_key(now)
        rest.sort(key=key)
        if not first:
            return rest
        first.sort(key=key)
        return first + rest

    def eviction_rank(self, now: float) -> Callable[[Request], tuple]:
        """Who keeps its KV when blocks run short: lower ranks are kept longer. Running decodes
        outrank every prefill (evicting one throws away admitted work and stalls its token
        stream); among decodes the newest goes first, as in vLLM. Then the prefills that have
        started, the oldest admitted first, and only then the policy's key, over those not
        started (which hold no KV, so it decides only whom they may evict: none that has
        started). A started prefill's place must not move as it is served: a slack key rises
        as its work shrinks, and two prefills that took turns evicting each other by it never
        finished (issue 52: 16K-token prompts under recompute, stuck at 49 of 60 done), while
        in admission order one evicted can never evict the older one that evicted it.
        Admission order breaks ties, so the rank is a total order."""
        key = self.sort_key(now)
        decoding = RequestState.DECODING
        return lambda r: (
            (0, r.arrival_s, r.admission_seq)
            if r.state is decoding
            else (1, 0, r.admission_seq)
            if r.started
            else (1, 1, key(r), r.admission_seq)
        )

    def may_evict_decodes(self, r: Request) -> bool:
        """Whether `r`, short of blocks, may evict running decodes ranked below it: a decode
        may; a prefill only evicts other prefills, so that admitting new work never throws away
        a running decode."""
        return r.state is RequestState.DECODING

    def urgent_prefill(self, queue: Iterable[Request], now: float) -> Request | None:
        """A prefill-phase request of `queue` that may make room for its whole context before
        the decodes join the batch, evicting decodes ranked below it (None: none may)."""
        return None

    def starts_before_swapped(self, r: Request, swapped: Iterable[Request]) -> bool:
        """Whether `r` may start its prefill while `swapped` requests wait to come back (no:
        they would starve behind new arrivals)."""
        return False

    def swap_in_order(self, swapped: list[Request], urgent: Request | None) -> list[Request]:
        """The swapped requests that may come back now, in the order they try (swap-out order)
        given the `urgent_prefill` waiting."""
        return swapped

    def slo_risk_victims(
        self,
        decodes: list[Request],
        swapped: Iterable[Request],
        step_time: StepTime,
        now: float,
    ) -> list[Request]:
        """Running decodes (of `decodes`, those in no running batch) to preempt as a batch
        starts forming, so that more urgent ones keep their TPOT targets (none by default).
        `step_time(kv_lens)` predicts a decode step over those context lengths, corrected by
        the measured iteration times; `swapped` are the requests waiting to come back."""
        return []


POLICIES: Registry[Policy] = Registry("policy", __package__, suffix="_policy")


def make_policy(name: str, config: SchedulerConfig | None = None) -> Policy:
    return POLICIES.get(name)(config)
