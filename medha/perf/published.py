"""A replica's batch-time model as data: what `medha serve` publishes (GET /medha/predictor) and
`medha route` rebuilds, so that the router prices each replica's work with the model that
replica plans with (its profile or the roofline of its own hardware, and the online
correction it has fitted to the batches it ran: issue 48), not with one taken on the router's
machine and named by a flag that must match.

The description is the model's inputs, not a table of its outputs: the model spec, the
hardware spec the roofline reads, the parallel layout, the profile a fitted predictor was
fitted to, and the correction's coefficients. The router builds the same predictor from them
(`predictor_from_description`), so it predicts what the replica predicts, shape for shape.
"""

from __future__ import annotations

import dataclasses
import math

from medha.perf.hardware_specs import HardwareSpec
from medha.perf.model_specs import ModelSpec
from medha.perf.online_fit import NAMES, CorrectedPredictor
from medha.perf.parallel_config import ParallelConfig
from medha.perf.predictor import Predictor

FORMAT = "medha-predictor"
# the bases a description can name: those make_predictor builds from the specs alone, and the
# fitted one (its profile travels with it)
BASES = ("roofline", "roofline-padded", "roofline-eager", "roofline-graph", "roofline-graph-min")
PROFILED = "profiled"


class DescriptionError(ValueError):
    """A description the router cannot build a predictor from (it keeps its own)."""


def describe(predictor: Predictor, scheduler: object | None = None) -> dict | None:
    """`predictor` as data, or None for a model that cannot be described (a roofline-cta with
    its own rate, a toy): the replica then publishes nothing and the router keeps its own.
    With `scheduler`, the replica's SchedulerConfig as it stands (its defaults resolved, and
    resolved again as its model is corrected): the rules the router's model of the replica
    applies (medha/route/pricing.py: `published_scheduler`; perf/ imports nothing of scheduler/)."""
    corrected = isinstance(predictor, CorrectedPredictor)
    base = predictor.inner if corrected else predictor
    if base.name not in (*BASES, PROFILED) or type(base).__name__ == "CtaRooflinePredictor":
        return None
    return {
        "format": FORMAT,
        "version": 1,
        "base": base.name,
        "model": dataclasses.asdict(base.model),
        "hardware": base.hardware.to_json(),
        "parallel": dataclasses.asdict(base.parallel),
        "profile": base.profile.to_json() if base.name == PROFILED else None,
        "correction": (
            {"theta": list(predictor.theta), "fits": predictor.version} if corrected else None
        ),
        "scheduler": dataclasses.asdict(scheduler) if scheduler is not None else None,
    }


def base_of(description: dict) -> dict:
    """The part of a description that is fixed for a replica's life (all but the correction
    and the scheduler config, which move as the replica learns): a router rebuilds the base
    only when this changes."""
    return {k: v for k, v in description.items() if k not in ("correction", "scheduler")}


def _spec(cls, data: object, what: str):
    if not isinstance(data, dict):
        raise DescriptionError(f"{what} must be an object")
    try:
        spec = cls(**data)
    except (TypeError, ValueError) as e:
        raise DescriptionError(f"{what}: {e}") from None
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not (math.isfinite(value) and value >= 0):
            raise DescriptionError(f"{what}.{f.name} = {value!r} is not a number >= 0")
    return spec


def theta_of(description: dict) -> tuple[float, ...] | None:
    """The correction's coefficients (None: the replica corrects nothing)."""
    correction = description.get("correction")
    if correction is None:
        return None
    theta = correction.get("theta") if isinstance(correction, dict) else None
    if (
        not isinstance(theta, list)
        or len(theta) != len(NAMES)
        or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for x in theta
        )
    ):
        raise DescriptionError(f"correction.theta must be {len(NAMES)} numbers >= 0")
    return tuple(float(x) for x in theta)


def predictor_from_description(description: object) -> Predictor:
    """The predictor `description` (from `describe`) describes, corrected by its theta when it
    has one (a CorrectedPredictor then, whose theta later descriptions move). A description
    from a replica is checked as input from the network: DescriptionError for anything off,
    including a model that would predict a non-finite or non-positive time."""
    from medha.perf import make_predictor
    from medha.perf.profile_data import ProfileError, profile_from_json
    from medha.perf.profiled_predictor import ProfiledPredictor

    d = description
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise DescriptionError(f'not a predictor description (expected "format": "{FORMAT}")')
    base = d.get("base")
    if base not in (*BASES, PROFILED):
        raise DescriptionError(f"unknown base {base!r}; expected one of {(*BASES, PROFILED)}")
    model = _spec(ModelSpec, d.get("model"), "model")
    hardware = _spec(HardwareSpec, d.get("hardware"), "hardware")
    parallel = _spec(ParallelConfig, d.get("parallel"), "parallel")
    theta = theta_of(d)
    try:
        if base == PROFILED:
            profile = profile_from_json(d.get("profile"), "the replica's profile")
            predictor = ProfiledPredictor(model, hardware, parallel, profile)
        else:
            predictor = make_predictor(base, model, hardware, parallel)
        if theta is not None:
            predictor = CorrectedPredictor(predictor)
            predictor.set_theta(theta)
        probes = (
            predictor.shape_time([(128, 0)], ()),
            predictor.shape_time((), [1024] * 8),
        )
    except (ProfileError, TypeError, ValueError, ArithmeticError, KeyError, AttributeError) as e:
        raise DescriptionError(f"cannot build the predictor: {e}") from None
    if not all(math.isfinite(t) and t > 0 for t in probes):
        raise DescriptionError(f"the described model predicts {probes} s for small batches")
    return predictor
