"""$MEDHA_STEP_LOG: a JSON line per batch an executor reports back to its scheduler.

Each line holds the batch as it ran (the vLLM executor revises a batch to what vLLM ran), the
time it took, the time the model it was planned with gives it before this batch teaches the
model, the time planned for it, and the budget and arrival wait of the defaults it was planned
in. Appended, line-buffered: what the convoy benches read the prediction error and the
schedule from (medha/benchmark/step_errors.py; a paused step's own time leaves out the batches
run beside it, so its wall time from `scheduled_s` to `ended_s` is longer than `measured_s`).
"""

from __future__ import annotations

import json
import os

from medha.core.batch import Batch
from medha.perf.predictor import Predictor
from medha.scheduler.config import SchedulerConfig

STEP_LOG_ENV = "MEDHA_STEP_LOG"


class StepLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(STEP_LOG_ENV)
        return cls(path) if path else None

    def write(
        self,
        batch: Batch,
        measured_s: float,
        now: float,
        predictor: Predictor,
        config: SchedulerConfig,
    ) -> None:
        prefills, decodes = batch.shape()
        row = {
            "batch": batch.batch_id,
            "scheduled_s": batch.scheduled_at_s,
            "ended_s": now,
            "prefills": prefills,
            "decodes": decodes,
            "requests": [c.request.request_id for c in batch.prefills],
            "measured_s": measured_s,
            "predicted_s": predictor.shape_time(prefills, decodes),
            "planned_s": batch.predicted_time_s,
            "budget_s": config.iteration_budget_s,
            "arrival_wait_s": config.arrival_wait_s,
        }
        self._file.write(json.dumps(row) + "\n")
