"""The smallest simulator: one replica, one batch at a time, batch times from the predictor.

Tests, the demo and the chunk-plan tools use it; `medha simulate` builds on the same loop with
events, pipelining and several replicas. It is also the executor that pauses steps as medha's
engine does (SchedulerConfig.pause_steps): a pausable batch's time is split evenly over its
pause points (each layer's attention and MLP), and at each the requests that arrived
meanwhile are admitted and the batches `schedule_beside` forms run first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from medha.core.batch import Batch, BatchResult
from medha.core.request import Request
from medha.scheduler.config_defaults import pause_points
from medha.scheduler.replica_scheduler import ReplicaScheduler


def replay(
    scheduler: ReplicaScheduler,
    requests: Iterable[Request],
    batch_time: Callable[[Batch], float] | None = None,
    on_batch: Callable[[Batch, float], None] | None = None,
    time_limit_s: float = float("inf"),
) -> float:
    """Run `requests` (admitted at their arrival times) until all finish; returns the end time.

    `batch_time` defaults to the batch's predicted time (pass the truth, a model other than the
    scheduler's, to see its decisions on a machine it predicts wrong); `on_batch(batch, end)`
    sees every batch after the scheduler has applied it.
    """
    pending = sorted(requests, key=lambda r: r.arrival_s)
    now, i = (pending[0].arrival_s if pending else 0.0), 0
    time_of = batch_time or (lambda b: b.predicted_time_s)
    per_step = pause_points(scheduler.predictor)

    def admit(until: float) -> None:
        nonlocal i
        while i < len(pending) and pending[i].arrival_s <= until:
            scheduler.add_request(pending[i], until)
            i += 1

    def finish(batch: Batch, duration: float, end: float) -> None:
        scheduler.update(batch, BatchResult(duration), end)
        if on_batch:
            on_batch(batch, end)

    while i < len(pending) or scheduler.has_unfinished():
        admit(now)
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
        duration = time_of(batch)
        if batch.pausable:
            for _ in range(per_step - 1):  # at each pause point
                now += duration / per_step
                admit(now)
                while (beside := scheduler.schedule_beside(now)) is not None:
                    took = time_of(beside)
                    now += took
                    finish(beside, took, now)
                    admit(now)
            now += duration / per_step
        else:
            now += duration
        finish(batch, duration, now)
        if now > time_limit_s:
            raise RuntimeError(f"replay passed its time limit of {time_limit_s}s")
    return now
