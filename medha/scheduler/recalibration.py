"""How an executor's measured steps reach the replica scheduler's plan (issue 48, item 2).

A scheduler given a `StepLearner` (an executor's: medha's engine, the vLLM executor, the
simulator's replay of the convoy) holds a `Recalibration`, which owns the config as the caller
gave it and when the defaults it leaves unset are resolved again from the corrected model:
the start-up probe's loop, the learner's batch counts at which a resolution is due, and the
probe shapes' times of the last one. The scheduler applies what it resolves (its config, packer
and policy are its own); the simulator attaches no learner, so its defaults never move.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from medha.perf.online_fit import StepLearner, probe_shapes
from medha.perf.predictor import Predictor
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config

log = logging.getLogger("medha.scheduler")

# A learner's batch count at which the defaults are first resolved again from its corrections
# (then at every doubling: Recalibration.redefault_due)
REDEFAULT_FIRST = 16
# ... and how far a probe shape's time must have moved since the last resolution (relative)
REDEFAULT_MOVE = 0.1


class Recalibration:
    def __init__(self, given: SchedulerConfig, predictor: Predictor, learner: StepLearner) -> None:
        """`given`: the config as the caller set it (the defaults it leaves unset follow the
        learner's corrections); `predictor`: the model `learner` corrects."""
        self.given = given
        self.predictor = predictor
        self.learner = learner
        self._redefault_at = REDEFAULT_FIRST  # the learner's batches at the next re-resolution
        # the probe shapes' times the defaults were last resolved from
        self._resolved_probes = learner.probe_times()

    def probe(self, measure: Callable[[list, list], float | None], context: int) -> tuple[int, int]:
        """The learner's probe shapes within `context` tokens, each timed by
        `measure(prefills, decodes)` (None: skipped) and shown to the learner, which then
        acknowledges its corrections whatever `measure` raises. (timed, skipped)."""
        timed = skipped = 0
        try:
            for prefills, decodes in probe_shapes(context):
                seconds = measure(prefills, decodes)
                if seconds is None:
                    skipped += 1
                    continue
                self.learner.observe(prefills, decodes, seconds)
                timed += 1
        finally:
            self.learner.moved()
        return timed, skipped

    def redefault_due(self) -> bool:
        """Whether the learner's batch count reached the next re-resolution: its 16th batch,
        then each time its count doubles (an early model knows few shapes)."""
        if self.learner.observed < self._redefault_at:
            return False
        self._redefault_at *= 2
        return True

    def resolve_again(self, config: SchedulerConfig) -> SchedulerConfig | None:
        """The defaults the given config left unset (the TPOT target and budget, the deadline
        floor, the arrival wait: resolve_config) resolved again from the corrected model, or
        None where they stay `config`'s. It resolves only where a probe shape's time moved by
        more than REDEFAULT_MOVE since the last resolution: one walks the chunking price over a
        max-length prompt (0.1-0.2 s in Python)."""
        probes = self.learner.probe_times()
        if all(
            abs(a / b - 1) <= REDEFAULT_MOVE for a, b in zip(probes, self._resolved_probes) if b > 0
        ):
            return None
        self._resolved_probes = probes
        resolved = resolve_config(self.given, self.predictor)
        if resolved == config:
            return None
        log.info(
            "defaults resolved again from the corrected model after %d batches: TPOT target "
            "%.3g s, iteration budget %.3g s, arrival wait %.3g s, TTFT deadline floor %.3g s",
            self.learner.observed, resolved.tpot_target_s, resolved.iteration_budget_s,
            resolved.arrival_wait_s, resolved.min_ttft_deadline_s,
        )  # fmt: skip
        return resolved
