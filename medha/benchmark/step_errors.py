"""How far a replica's predicted batch times are from its measured ones, batch by batch
(issue 48's figure): read from medha's engine (EngineMetrics samples) or from the step log of
medha's scheduler on vLLM (MEDHA_STEP_LOG, medha/vllm_executor/scheduler.py); and the
iteration budgets a step log's batches were planned in over a span of time (the defaults a
server resolved, and resolved again as its model was corrected)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SETTLED = 0.15  # within 15%
IN_A_ROW = 8


def prediction_error(pairs: list[tuple[float, float]]) -> tuple[float, int, int | None]:
    """(median |measured / predicted - 1| over every (measured, predicted) batch from the
    first, how many batches, after how many batches IN_A_ROW in a row were within SETTLED:
    None if never)."""
    errors = [abs(measured / predicted - 1) for measured, predicted in pairs if predicted]
    if not errors:
        return float("nan"), 0, None
    settled = next(
        (i for i in range(len(errors) - IN_A_ROW + 1) if max(errors[i : i + IN_A_ROW]) <= SETTLED),
        None,
    )
    return statistics.median(errors), len(errors), settled


def step_rows(path: str | Path) -> list[dict]:
    """Every step of a MEDHA_STEP_LOG file, in order (medha/scheduler/step_log.py)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def read_step_log(path: str | Path) -> list[tuple[float, float]]:
    """(measured, predicted) of every step in a MEDHA_STEP_LOG file, in order."""
    return [(row["measured_s"], row["predicted_s"]) for row in step_rows(path)]


def budgets_between(path: str | Path, start_s: float, end_s: float) -> dict[float, int]:
    """{iteration budget: batches} of the batches a MEDHA_STEP_LOG file shows scheduled from
    `start_s` to `end_s` (time.monotonic, the clock every process of the machine shares), in
    the order each budget first appeared; {} without a log."""
    path = Path(path)
    if not path.exists():
        return {}
    seen: dict[float, int] = {}
    for row in step_rows(path):
        if start_s <= row["scheduled_s"] <= end_s:
            seen[row["budget_s"]] = seen.get(row["budget_s"], 0) + 1
    return seen
