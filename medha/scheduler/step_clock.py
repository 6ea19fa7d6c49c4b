"""The replica scheduler's step clock: how long the executor's steps take as the scheduler
plans them, and when a decode's next token falls due.

A step's time is the predictor's, times `step_scale`: how much longer than predicted batches
run, an exponential average of measured over predicted batch time (exactly 1 in the simulator,
whose batches take their predicted time). The SLO-risk preemption reads it (a class policy's
`slo_risk_victims`), and so does pause_steps, which asks whether a decode must run now.
"""

from __future__ import annotations

from medha.core.batch import Batch
from medha.core.request import Request
from medha.perf.predictor import Predictor
from medha.scheduler.config_defaults import pause_parts

# Weight of the newest batch in `step_scale`: the article on Orca/Sarathi scheduling (seed 001)
# keeps its iteration time as an exponential average with this weight.
STEP_SCALE_WEIGHT = 0.1


class StepClock:
    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor
        # how much longer than predicted batches run, averaged over recent ones (1 in the
        # simulator, whose batches take their predicted time)
        self.step_scale = 1.0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """One batch's predicted and measured time (both positive and finite)."""
        self.step_scale += STEP_SCALE_WEIGHT * (measured_s / predicted_s - self.step_scale)

    def decode_step_time(self, kv_lens: list[int]) -> float:
        """A decode step over these context lengths as the executor will run it: predicted,
        times the measured / predicted ratio of recent batches."""
        return self.predictor.shape_time((), kv_lens) * self.step_scale

    def pause_part_s(self, paused: Batch | None) -> float:
        """The longest time from one pause point of the pausable batch in flight (`paused`) to
        the next: its layers' attention part or MLP part, the longer (`pause_parts`; as
        predicted, times the measured / predicted ratio of recent batches); 0 without one."""
        if paused is None:
            return 0.0
        return max(pause_parts(self.predictor, paused)) * self.step_scale

    def decode_due(
        self, decodes: list[Request], now: float, budget_s: float, paused: Batch | None
    ) -> bool:
        """Whether one of `decodes` must run now to keep its pace (`token_due_s`), less the
        time of a step of these decodes and, beside a paused step, of the part of it to its
        next pause point."""
        step = self.decode_step_time([r.num_scheduled for r in decodes]) + self.pause_part_s(paused)
        spp = self.predictor.parallel.spp
        return any(token_due_s(r, budget_s, spp) - step <= now for r in decodes)


def token_due_s(r: Request, budget_s: float, spp: int) -> float:
    """When decode `r`'s next token falls due. A request that said nothing keeps a reading
    pace: its last token plus the iteration budget `budget_s`. One with its own TPOT target
    keeps it as a mean over its answer (`Request.own_due_s`): the long prefill paused beside it
    spends the time its faster tokens saved instead of reading the weights again for a step
    of decodes that no target asks for (issue 69: on Azure code at 0.35 req/s each such step
    cost 25-35 ms, and a 4,868-token prompt missed a 2 s TTFT). A target looser than the
    budget counts too."""
    due = r.own_due_s(spp)
    return r.token_times_s[-1] + budget_s if due is None else due
