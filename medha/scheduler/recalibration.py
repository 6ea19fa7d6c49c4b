"""How an executor's measured steps reach the replica scheduler's plan (issue 48, item 2).

A scheduler given a `StepLearner` (an executor's: medha's engine, the vLLM executor, the
simulator's replay of the convoy) holds a `Recalibration`, which owns the config as the caller
gave it and when the defaults it leaves unset are resolved again from the corrected model:
the start-up probe's loop, the learner's batch counts at which a resolution is due, the probe
shapes' times of the last one, the regime it resolved in, the load the engine has run (how
many decodes a prefill chunk has had beside it) and the resolution in progress. The scheduler
applies what it resolves (its config, packer and policy are its own); the simulator attaches no
learner, so its defaults never move.

A resolution walks a max-length prompt's chunks many times over (milliseconds in Python, tens
of them where the model's step times are not cached yet; at a 32K context, whose walks run
over 2,000 chunks each, 0.5-0.8 s). Given `slice_s`, one due at a batch is spread over the
batches that follow, `slice_s` of it on each (as timed by `clock`), on a snapshot of the model
as it stood when it began: an executor's step never waits for a whole one (issue 69: on vLLM at
256 running, 3-10 ms of a step that otherwise spends 0.5-0.7 ms in medha). Given `slice_steps`
instead, each batch runs that many chunks of its walks: no clock is read, so the simulator's
replay of the convoy makes medha's engine's decisions. Without either it ends on the batch it
is due.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from medha.perf.chunking_price import Steps, finish
from medha.perf.online_fit import StepLearner, probe_shapes
from medha.perf.predictor import Predictor
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import Resolution, resolve_steps

log = logging.getLogger("medha.scheduler")

# A learner's batch count at which the defaults are first resolved again from its corrections
# (then at every doubling: Recalibration.redefault_due)
REDEFAULT_FIRST = 16
# ... and how far a probe shape's time must have moved since the last resolution (relative)
REDEFAULT_MOVE = 0.1


# The vLLM executor's slice of a resolution a batch: a tenth of a millisecond, a few of a walk's
# chunks (each a few model evaluations, 1.5 us warm and about 10 us where the roofline's step
# times are not cached yet; the first chunk of a walk, a search from scratch, up to 0.1 ms),
# against the goal of 1 ms for medha's part of a vLLM step at the 99th percentile
# (bench/vllm/vllm_overhead.py), where a step at 256 running spends 0.5-0.7 ms in medha
# anyway. A slice of 0.2 ms ran to 0.2-0.33 ms and put such steps at 1.0-1.16 ms; at 0.1 ms a
# resolution (0.5-2.6 ms warm on the AMX Xeon; the first, cold, about 14 ms) lands 5-30 steps
# after it is due (the first about 140).
RESOLVE_SLICE_S = 1e-4
# medha's engine's slice, in chunks of a walk (each 1.5-30 us: 0.3-6 ms a batch, against CPU
# steps of 20 ms to seconds): counted, not timed, so that the simulator's replay of the convoy
# (tests/test_machine_kinds.py) makes the engine's decisions. A resolution walks about 60
# chunks at SmolLM2's 2,048 tokens (it ends on the batch it is due, as one at once did), 420 at
# 8K (3 batches) and 5,700 at 32K (29 batches), where one at once held every stream for
# 0.5-0.8 s (a batch of 4 decodes takes 25 ms there).
RESOLVE_SLICE_STEPS = 200
# what a resolution spread over batches yields while it has not ended
_UNFINISHED = object()


class Recalibration:
    def __init__(
        self,
        given: SchedulerConfig,
        predictor: Predictor,
        learner: StepLearner,
        slice_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        slice_steps: int | None = None,
    ) -> None:
        """`given`: the config as the caller set it (the defaults it leaves unset follow the
        learner's corrections); `predictor`: the model `learner` corrects; `slice_s`: how much
        of a resolution one batch may run, by `clock`, or `slice_steps`: how many chunks of its
        walks (neither: a whole one)."""
        if slice_s is not None and not slice_s > 0:
            raise ValueError(f"slice_s must be > 0 or None, got {slice_s!r}")
        if slice_steps is not None and not (isinstance(slice_steps, int) and slice_steps > 0):
            raise ValueError(f"slice_steps must be an int > 0 or None, got {slice_steps!r}")
        if slice_s is not None and slice_steps is not None:
            raise ValueError("a resolution is sliced by time (slice_s) or by chunks, not both")
        self.given = given
        self.predictor = predictor
        self.learner = learner
        self.slice_s = slice_s
        self.slice_steps = slice_steps
        self.spread = slice_s is not None or slice_steps is not None
        self._clock = clock
        self._redefault_at = REDEFAULT_FIRST  # the learner's batches at the next re-resolution
        # the probe shapes' times the defaults were last resolved from
        self._resolved_probes = learner.probe_times()
        self._pending: Steps[Resolution] | None = None  # the resolution in progress
        self._reprice_due = False  # one spread over batches ended: the next batch reprices
        # the regime the defaults hold (config_defaults.affordable) since a resolution from the
        # corrected model: not the base's, which the start-up probe or the first batches
        # correct by factors (a CPU's roofline, 2-6x off, puts it in the 0.05 s regime)
        self._held: bool | None = None
        # the batches run with a prefill chunk, and the decodes beside their chunks
        self._chunk_batches = 0
        self._decodes_beside = 0

    def saw(self, prefills: int, decodes: int) -> None:
        """One batch the engine ran (not a probe): its prefill chunks and decodes, the load the
        defaults' regime is priced for (`beside`)."""
        if prefills:
            self._chunk_batches += 1
            self._decodes_beside += decodes

    @property
    def beside(self) -> int:
        """The decodes a prefill chunk has had beside it in this engine's batches, on average
        (rounded; at least one: a step's budget binds only where someone shares it). vLLM's
        steps carry both (the convoy's replay: 4.5 a chunk); medha's engine runs its decodes in
        batches of their own beside a paused step, so it counts one, as the rule did before."""
        if not self._chunk_batches:
            return 1
        return max(1, round(self._decodes_beside / self._chunk_batches))

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
        """At once (the start-up probe's end): the defaults the given config left unset (the
        TPOT target and budget, the deadline floor, the arrival wait: resolve_config) resolved
        again from the corrected model, or None where they stay `config`'s. It resolves only
        where a probe shape's time moved by more than REDEFAULT_MOVE since the last resolution,
        and supersedes one in progress."""
        self._pending = None
        if not self._probes_moved():
            return None
        return self._resolved(config, finish(self._resolve_steps(self.predictor)))

    def follow(self, config: SchedulerConfig, moved: bool) -> tuple[SchedulerConfig | None, bool]:
        """After each batch the learner was shown (`moved`: its correction moved the model):
        a resolution begins where one is due (`redefault_due`, and a probe shape moved as in
        `resolve_again`), and the one in progress runs a slice further. (The defaults it
        resolved once it ends, or None: none ended, or they stay `config`'s; whether the
        requests in prefill are to be priced again now.)

        Spread over batches, a batch that reprices runs no slice, and the batch whose slice
        ends a resolution leaves the repricing to the next one: on vLLM at 256 running a slice
        and a repricing each take 0.1-0.3 ms, against the goal of 1 ms for medha's part of a
        step (issue 69). At once, both land on the same batch."""
        reprice, self._reprice_due = moved or self._reprice_due, False
        due = self.redefault_due()
        if self._pending is None:
            if not (due and self._probes_moved()):
                return None, reprice
            # (spread over batches, every walk prices one model, whatever the learner does)
            model = self.predictor.snapshot() if self.spread else self.predictor
            self._pending = self._resolve_steps(model)
        if reprice and self.spread:
            return None, True
        resolved = self._advance()
        if resolved is _UNFINISHED:
            return None, reprice
        self._pending = None
        resolved = self._resolved(config, resolved)
        if resolved is not None:  # the requests' work follows it: now, or spread, next batch
            if not self.spread:
                reprice = True
            else:
                self._reprice_due = True
        return resolved, reprice

    def _resolve_steps(self, model: Predictor) -> Steps[Resolution]:
        """The given config resolved from `model`, for the load run so far, a price past the
        line by a margin needed to leave the regime held (config_defaults.affordable)."""
        return resolve_steps(self.given, model, self.beside, self._held)

    def _probes_moved(self) -> bool:
        """Whether a probe shape's time moved by more than REDEFAULT_MOVE since the last
        resolution (then it is this one's)."""
        probes = self.learner.probe_times()
        if all(
            abs(a / b - 1) <= REDEFAULT_MOVE for a, b in zip(probes, self._resolved_probes) if b > 0
        ):
            return False
        self._resolved_probes = probes
        return True

    def _advance(self):
        """The resolution in progress, a slice further: its value, or _UNFINISHED."""
        pending = self._pending
        if not self.spread:
            return finish(pending)
        try:
            if self.slice_steps is not None:
                for _ in range(self.slice_steps):
                    next(pending)
                return _UNFINISHED
            end = self._clock() + self.slice_s
            while True:
                next(pending)
                if self._clock() >= end:
                    return _UNFINISHED
        except StopIteration as done:
            return done.value

    def _resolved(self, config: SchedulerConfig, resolution: Resolution) -> SchedulerConfig | None:
        """`resolution`'s config, logged, or None where it is `config`; its regime is held from
        now on."""
        resolved = resolution.config
        if resolution.affordable is not None:
            self._held = resolution.affordable
        if resolved == config:
            return None
        log.info(
            "defaults resolved again from the corrected model after %d batches (%d decodes beside "
            "a chunk): TPOT target %.3g s, iteration budget %.3g s, arrival wait %.3g s, TTFT "
            "deadline floor %.3g s",
            self.learner.observed, self.beside, resolved.tpot_target_s,
            resolved.iteration_budget_s, resolved.arrival_wait_s, resolved.min_ttft_deadline_s,
        )  # fmt: skip
        return resolved
