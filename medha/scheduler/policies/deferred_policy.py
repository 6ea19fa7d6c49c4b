"""Deferred prefill (Mohanty et al., EuroMLSys 2025): admit new prompts in groups.

Continuous batching starts a new prefill whenever a request leaves the batch. When a prefill
has a fixed cost of its own (an iteration that only prefills, as in vLLM without chunked
prefill), paying it for every departure wastes time; waiting for K departures pays it once per
K prompts, at the price of decoding with up to K fewer requests in the meantime. Throughput
peaks at an interior K (medha/analysis/deferred_prefill.py has the model, `medha analyze
deferred-prefill` the curve).

The batch is the set of admitted requests: a request is admitted when its group is let in and
leaves when it finishes or is aborted. A preempted request stays admitted (its re-prefill is
not a new prompt). Order within the queue is first come, first served.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

from medha.core.request import Request
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.policies.base_policy import POLICIES
from medha.scheduler.policies.fcfs_policy import FcfsPolicy


@POLICIES.register("deferred")
class DeferredPolicy(FcfsPolicy):
    pauses_steps = False  # (Policy.pauses_steps)
    summary = (
        "deferred prefill: fcfs, new prefills admitted only after K departures, at "
        "most C requests in the batch"
    )

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        config = self.config
        self.threshold = config.deferred.departure_threshold
        self.cap = config.running_cap
        self.admitted: dict[str, Request] = {}
        self.departures = 0  # since the last admission

    def admit(
        self, queue: list[Request], is_live: Callable[[str], bool], now: float
    ) -> list[Request]:
        gone = [rid for rid in self.admitted if not is_live(rid)]
        for rid in gone:
            del self.admitted[rid]
        self.departures += len(gone)
        # An empty batch has no one left to depart: it always admits, or it would wait forever.
        if self.departures >= self.threshold or not self.admitted:
            self._admit_group(queue)
        # O(C), not O(backlog): the queue holds every prefill-phase request, admitted or not
        return [r for r in self.admitted.values() if r.in_prefill]

    def _admit_group(self, queue: list[Request]) -> None:
        room = self.cap - len(self.admitted)
        # The queue lists requests in the order they reached the scheduler (first come), so
        # the oldest waiting ones are found without scanning the whole backlog.
        fresh = list(islice((r for r in queue if r.request_id not in self.admitted), max(room, 0)))
        if not fresh:
            return  # the departures stay counted: the next arrival goes straight in
        self.admitted.update((r.request_id, r) for r in fresh)
        self.departures = 0
