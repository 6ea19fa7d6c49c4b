"""A replica's batch-time model as data (medha/perf/published.py): what `medha serve` publishes
at GET /medha/predictor and `medha route` rebuilds predicts what the replica predicts, and a
description that is off is refused, never half-built."""

import copy
import json
import math

import numpy as np
import pytest

from medha.perf import make_predictor
from medha.perf.online_fit import CorrectedPredictor
from medha.perf.profile_data import IterationRow, Profile
from medha.perf.profiled_predictor import ProfiledPredictor
from medha.perf.published import (
    DescriptionError,
    base_of,
    describe,
    predictor_from_description,
    theta_of,
)
from medha.route.app import published_scheduler
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config

SHAPES = [
    ([(1, 0)], []),
    ([(512, 0)], []),
    ([(256, 4096)], [2048] * 8),
    ([], [128]),
    ([], [4096] * 32),
]


def times(p) -> list[float]:
    return [p.shape_time(prefills, decodes) for prefills, decodes in SHAPES]


def over_the_wire(p):
    """`p` described, sent as JSON, rebuilt."""
    return predictor_from_description(json.loads(json.dumps(describe(p))))


def test_a_roofline_and_its_online_correction_round_trip():
    base = make_predictor("roofline", "smollm2-135m", "cpu")
    assert times(over_the_wire(base)) == times(base)
    corrected = CorrectedPredictor(make_predictor("roofline", "llama-3-8b", "h200"))
    corrected.set_theta((0.004, 1e-5, 2.5, 1.5, 3.0))
    rebuilt = over_the_wire(corrected)
    assert isinstance(rebuilt, CorrectedPredictor) and rebuilt.theta == corrected.theta
    assert times(rebuilt) == pytest.approx(times(corrected), rel=1e-12)
    # the correction is the only part that moves while a replica runs
    d = describe(corrected)
    corrected.set_theta((0.0, 0.0, 1.0, 1.0, 1.0))
    assert base_of(describe(corrected)) == base_of(d) and theta_of(d) != corrected.theta


def test_a_fitted_profile_travels_with_its_model():
    truth = make_predictor("roofline", "smollm2-135m", "h100")
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(120):
        prefills = [(int(rng.integers(1, 2048)), int(rng.integers(0, 4000)))]
        decodes = [int(k) for k in rng.integers(1, 4000, size=rng.integers(0, 16))]
        rows.append(
            IterationRow(1, tuple(prefills), tuple(decodes), truth.shape_time(prefills, decodes))
        )
    fitted = ProfiledPredictor(
        truth.model, truth.hardware, truth.parallel, Profile(["synthetic"], iteration_rows=rows)
    )
    assert times(over_the_wire(fitted)) == pytest.approx(times(fitted), rel=1e-9)


def test_models_it_cannot_describe_publish_nothing():
    cta = make_predictor("roofline-cta:50", "smollm2-135m", "h100")
    assert describe(cta) is None


def _broken(mutate) -> dict:
    d = describe(CorrectedPredictor(make_predictor("roofline", "smollm2-135m", "cpu")))
    d = copy.deepcopy(d)
    mutate(d)
    return d


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format="medha-profile"),
        lambda d: d.update(base="magic"),
        lambda d: d.update(model=[1, 2]),
        lambda d: d["model"].update(hidden_size=-1),
        lambda d: d["model"].update(surprise=1),
        lambda d: d["hardware"].update(mem_bw=math.inf),
        lambda d: d["hardware"].update(mem_bw=0.0),  # every time infinite
        lambda d: d["parallel"].update(tp=0),
        lambda d: d["correction"].update(theta=[1.0, 1.0]),
        lambda d: d["correction"].update(theta=[0, 0, 1, 1, math.nan]),
        lambda d: d["correction"].update(theta=[0, 0, -1, 1, 1]),
        lambda d: d["correction"].update(theta=[0, 0, True, 1, 1]),
        lambda d: d.update(correction="fast"),
        lambda d: d.update(base="profiled", profile={"format": "medha-profile", "iterations": 3}),
        lambda d: d.update(base="profiled", profile=None),
        lambda d: d.update(base="profiled", profile={"format": "medha-profile"}),  # no data
    ],
)
def test_a_description_that_is_off_is_refused(mutate):
    with pytest.raises(DescriptionError):
        predictor_from_description(_broken(mutate))
    with pytest.raises(DescriptionError):
        predictor_from_description("not even an object")


def _with_scheduler(**settings) -> tuple[dict, SchedulerConfig]:
    p = make_predictor("roofline", "smollm2-135m", "cpu")
    config = resolve_config(SchedulerConfig(policy="edf", **settings), p)
    return json.loads(json.dumps(describe(p, config))), config


def test_the_scheduler_config_travels_beside_the_model():
    """A replica publishes the scheduler config it runs, flags and resolved defaults alike; it
    moves as the replica resolves its defaults again, so it is not part of the base."""
    d, config = _with_scheduler(overload_steps=False, arrival_wait_s=0.3)
    got = published_scheduler(d)
    assert got == config and got.overload_steps is False and got.arrival_wait_s == 0.3
    assert base_of(d) == base_of(_with_scheduler(tpot_target_s=0.2)[0])
    assert published_scheduler(describe(make_predictor("roofline", "smollm2-135m", "cpu"))) is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: "fast",
        lambda s: {**s, "surprise": 1},
        lambda s: {**s, "policy": "magic"},
        lambda s: {**s, "arrival_wait_s": -1.0},
        lambda s: {**s, "iteration_budget_s": math.nan},
        lambda s: {**s, "lars": 3},
        lambda s: {**s, "max_num_seqs": 0},
        lambda s: {**s, "tpot_target_s": None},  # not resolved
    ],
)
def test_a_scheduler_config_that_is_off_is_refused(mutate):
    d, _ = _with_scheduler()
    d["scheduler"] = mutate(d["scheduler"])
    with pytest.raises(DescriptionError):
        published_scheduler(d)
