"""The smallest simulator: one replica, one batch at a time, batch times from the predictor.

Tests, the demo and the chunk-plan tools use it; `medha simulate` builds on the same loop with
events, pipelining and several replicas. It is also the executor that pauses steps as medha's
engine does (SchedulerConfig.pause_steps): a pausable batch's time is split over its pause
points (each layer's attention and MLP), evenly or, with `layer_parts`, as the engine's layers
split it (`config_defaults.pause_parts`: the attention part grows with the context), and at
each the requests that arrived meanwhile are admitted and the batches `schedule_beside` forms
run first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from medha.core.batch import Batch, BatchResult
from medha.core.request import Request
from medha.scheduler.config_defaults import pause_parts, pause_points
from medha.scheduler.replica_scheduler import ReplicaScheduler


def replay(
    scheduler: ReplicaScheduler,
    requests: Iterable[Request],
    batch_time: Callable[[Batch], float] | None = None,
    on_batch: Callable[[Batch, float], None] | None = None,
    time_limit_s: float = float("inf"),
    layer_parts: bool = False,
) -> float:
    """Run `requests` (admitted at their arrival times) until all finish; returns the end time.

    `batch_time` defaults to the batch's predicted time (pass the truth, a model other than the
    scheduler's, to see its decisions on a machine it predicts wrong); `on_batch(batch, end)`
    sees every batch after the scheduler has applied it. `layer_parts`: a paused step's parts
    as its layers split it rather than even (the convoy's checks replay even parts: with the
    layers' split, 2 of tests/test_machine_kinds.py's 108 engine convoys put the shorts at
    1.50-1.52x their time alone, since the arrival wait sizes a paused step by its mean part).
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
            parts = [duration / per_step] * per_step
            if layer_parts:
                attention, mlp = pause_parts(scheduler.predictor, batch)
                if attention + mlp > 0:  # (scaled to the batch's duration)
                    scale = 2 * duration / per_step / (attention + mlp)
                    parts = [attention * scale, mlp * scale] * (per_step // 2)
            for part in parts[:-1]:  # to each pause point
                now += part
                admit(now)
                while (beside := scheduler.schedule_beside(now)) is not None:
                    took = time_of(beside)
                    now += took
                    finish(beside, took, now)
                    admit(now)
            now += parts[-1]
        else:
            now += duration
        finish(batch, duration, now)
        if now > time_limit_s:
            raise RuntimeError(f"replay passed its time limit of {time_limit_s}s")
    return now
