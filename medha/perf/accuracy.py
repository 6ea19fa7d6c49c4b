"""How well the predictors reproduce measured op timings they were not fitted on."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np

from medha.perf.fitting import PiecewiseLinear
from medha.perf.hardware_specs import HardwareSpec
from medha.perf.model_specs import ModelSpec
from medha.perf.parallel_config import ParallelConfig
from medha.perf.profile_data import Profile
from medha.perf.roofline_predictor import RooflinePredictor


def op_holdout_errors(
    profile: Profile,
    model: ModelSpec,
    hardware: HardwareSpec,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> dict[str, dict]:
    """Per op: relative errors of a fit on the other rows, and of the analytic model, on a
    random `test_fraction` of each (op, TP degree) group of rows."""
    rng = random.Random(seed)
    groups: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    for op, n, tp, seconds in profile.op_rows:
        groups[(op, tp)].append((n, seconds))
    analytic = {}
    errors: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"fitted": [], "analytic": []})
    for (op, tp), rows in sorted(groups.items()):
        order = list(range(len(rows)))
        rng.shuffle(order)
        held = set(order[: max(1, int(len(rows) * test_fraction))])
        train = [rows[i] for i in range(len(rows)) if i not in held]
        fit = PiecewiseLinear.fit([x for x, _ in train], [y for _, y in train])
        if tp not in analytic:
            analytic[tp] = RooflinePredictor(model, hardware, ParallelConfig(tp=tp))
        for i in held:
            n, y = rows[i]
            errors[op]["fitted"].append(abs(fit(n) - y) / y)
            errors[op]["analytic"].append(abs(analytic[tp].op_time(op, n) - y) / y)
    return dict(errors)


def summarize(errors: dict[str, dict]) -> dict[str, dict[str, float]]:
    out = {}
    for op, e in errors.items():
        out[op] = {
            f"{kind}_{stat}": float(np.percentile(v, q))
            for kind, v in e.items()
            for stat, q in (("median", 50), ("p95", 95))
        }
        out[op]["rows"] = len(e["fitted"])
    every = {kind: [x for e in errors.values() for x in e[kind]] for kind in ("fitted", "analytic")}
    out["all ops"] = {
        f"{kind}_{stat}": float(np.percentile(v, q))
        for kind, v in every.items()
        for stat, q in (("median", 50), ("p95", 95))
    }
    out["all ops"]["rows"] = len(every["fitted"])
    return out
