"""(pause_steps) The pausable step in flight, as the replica scheduler sees it while the executor
pauses it between layers (medha/engine/pauses.py; docs/design.md, "Paused steps"): how long it
has still to run, and who may not wait for its end. It owns the pausable batch in flight and
the predicted time of the batches run beside it; ReplicaScheduler forms those batches.
"""

from __future__ import annotations

from collections.abc import Iterable

from medha.core.batch import Batch
from medha.core.request import Request
from medha.scheduler.replica_rules import is_long
from medha.scheduler.step_clock import StepClock


class PausedStep:
    def __init__(self, clock: StepClock, long_threshold: int) -> None:
        self.clock = clock
        self.long_threshold = long_threshold
        self.batch: Batch | None = None  # the pausable batch in flight
        self.beside_s = 0.0  # the predicted time of those run beside it so far

    def began(self, batch: Batch) -> None:
        self.batch, self.beside_s = batch, 0.0

    def ended(self, batch: Batch) -> None:
        if batch is self.batch:
            self.batch = None

    def ran_beside(self, batch: Batch) -> None:
        self.beside_s += batch.predicted_time_s

    def beside_budget_s(self, iteration_budget_s: float) -> float:
        """The most a batch beside it may take with a long prefill's chunk in it: that chunk
        ends in time for the decodes' next tokens, which come after it and the paused step's
        next part (the longer of its two)."""
        return max(0.0, iteration_budget_s - self.clock.pause_part_s(self.batch))

    def left_s(self, now: float) -> float:
        """How long it has still to run, as predicted (times the measured / predicted ratio of
        recent batches), with the batches run beside it so far; 0 without one."""
        paused = self.batch
        if paused is None:
            return 0.0
        end = paused.scheduled_at_s + paused.predicted_time_s * self.clock.step_scale
        return max(0.0, end + self.beside_s - now)

    def anyone_waits(
        self, prefilling: Iterable[Request], decodes: list[Request], budget_s: float, now: float
    ) -> bool:
        """Whether anyone waits on steps now: a short prefill (one whose turn is a step, not its
        whole prefill: replica_rules.is_long), a long prefill that cannot wait out the paused
        step (`cannot_wait`), each with no batch in flight, or one of `decodes` (those ready)
        whose next token is due (StepClock.decode_due). Other long prefills wait for their
        whole prefill and pause nothing."""
        left = self.left_s(now)
        if any(self.waits_on_steps(r, now, left) for r in prefilling):
            return True
        return bool(decodes) and self.clock.decode_due(decodes, now, budget_s, self.batch)

    def waits_on_steps(self, r: Request, now: float, left_s: float) -> bool:
        """Whether prefill `r`, with no batch in flight, waits on steps (their end, not its
        whole prefill): a short one, or a long one that cannot wait out the paused step,
        `left_s` from its end (`cannot_wait`)."""
        if r.num_inflight_batches:
            return False
        return not is_long(r, self.long_threshold) or self.cannot_wait(r, now, left_s)

    def cannot_wait(self, r: Request, now: float, left_s: float) -> bool:
        """Whether long prefill `r` runs beside the paused step, `left_s` from its end: it meets
        its TTFT deadline only if it does not wait for that end (its slack is less than
        `left_s`, and not yet spent), its whole prefill is shorter than the wait, and the
        paused step's own prefills keep their deadlines after it (their slack covers its work;
        one already predicted to miss its deadline holds no one back, as in LARS's
        serve-early: waiting moves no deadline it can still meet).
        A paused step runs up to the arrival wait (1.5-3 s on a CPU), so a prompt just past the
        long threshold that arrives during one would wait for it longer than its whole prefill
        takes (issue 69: on Azure code at 0.35 req/s, 2,692 tokens took 2.79 s against 1.27 s
        under vLLM). A longer one waits, and joins the next step's prefills; one whose deadline
        has passed waits as at any step (a step could not save it)."""
        paused = self.batch
        if paused is None or not is_long(r, self.long_threshold):
            return False
        work = r.remaining_work_s
        return (
            0 <= r.slack(now) < left_s
            and work <= left_s
            and all(not 0 <= c.request.slack(now) < work for c in paused.prefills)
        )
