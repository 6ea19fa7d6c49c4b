"""The smallest simulator: one replica, one batch at a time, batch times from the predictor.

Tests, the demo and the chunk-plan tools use it; `medha simulate` builds on the same loop with
events, pipelining and several replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from medha.core.batch import Batch, BatchResult
from medha.core.request import Request
from medha.scheduler.replica_scheduler import ReplicaScheduler


def replay(
    scheduler: ReplicaScheduler,
    requests: Iterable[Request],
    batch_time: Callable[[Batch], float] | None = None,
    on_batch: Callable[[Batch, float], None] | None = None,
    time_limit_s: float = float("inf"),
) -> float:
    """Run `requests` (admitted at their arrival times) until all finish; returns the end time.

    `batch_time` defaults to the batch's predicted time; `on_batch(batch, end)` sees every batch
    after the scheduler has applied it.
    """
    pending = sorted(requests, key=lambda r: r.arrival_s)
    now, i = (pending[0].arrival_s if pending else 0.0), 0
    while i < len(pending) or scheduler.has_unfinished():
        while i < len(pending) and pending[i].arrival_s <= now:
            scheduler.add_request(pending[i], now)
            i += 1
        batch = scheduler.schedule(now)
        if batch is None:
            # idle until the next arrival, or until the policy lets held prefills go
            wake = scheduler.wake_at()
            wake = wake if wake is not None and wake > now else float("inf")
            if i == len(pending) and wake == float("inf"):
                raise RuntimeError(
                    f"scheduler stalled at t={now:.3f}s with {len(scheduler)} unfinished requests"
                )
            now = min(wake, pending[i].arrival_s if i < len(pending) else wake)
            continue
        duration = batch_time(batch) if batch_time else batch.predicted_time_s
        now += duration
        scheduler.update(batch, BatchResult(duration), now)
        if on_batch:
            on_batch(batch, now)
        if now > time_limit_s:
            raise RuntimeError(f"replay passed its time limit of {time_limit_s}s")
    return now
