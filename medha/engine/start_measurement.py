"""What an engine with no profile of its own measures of itself before serving.

Two measurements, either of which LLMEngine runs once at start (medha/engine/setup.py says
when: `self_profile_due`, `start_probe_due`):

- the self-profile (`profile_self`, --self-profile-s): a grid of batch shapes timed for a
  budget, written where `medha profile` writes, which the engine then plans with (issue 48);
- the start-up probe (`probe_start`, --start-probe): the online correction's few probe shapes,
  timed once each to correct the roofline before the first request (a few seconds).

No start-up measurement ends a start (issue 68): one that fails leaves the engine planning with
what it had, corrected online.
"""

from __future__ import annotations

import logging
import time

from medha.engine.errors import is_fatal

log = logging.getLogger("medha.engine")

# fewer timed shapes than this (a machine too slow for --self-profile-s) fit no model worth
# planning with: the engine keeps the roofline, corrected online, and writes nothing
MIN_SELF_PROFILE_ROWS = 8
# the most the start-up probe spends (`probe_start`): SmolLM2 in bf16 on a 2-core Xeon takes
# 2.8 s for all six shapes; a layout whose long shapes run far slower (KVP in float32 on torch's
# kernels: 69 s) skips them and learns them online
PROBE_BUDGET_S = 10.0


def profile_self(engine) -> bool:
    """Time a grid of batch shapes on `engine` (an LLMEngine being built: not imported here,
    it imports this) for about --self-profile-s seconds (the quick grid up to its context and
    max_num_seqs, corners first: medha/perf/grid.py) and write it where `medha profile` writes,
    so that the engine plans with it (issue 48: no manual step before the scheduler knows its
    engine). Whether the engine plans again: from the profile written, or, after a failure,
    from a fresh cache as it started; too few shapes timed keep its plan."""
    from medha.engine.profiler import Profiler
    from medha.perf.grid import corners_first, grid

    seconds, path = engine.config.self_profile_s, engine.profile_path
    shapes = grid(
        engine.max_model_len,
        engine.kv_capacity_tokens,
        mixed=8,
        seed=0,
        quick=True,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
    )
    log.warning(
        "no profile of this engine at %s: timing up to %d batch shapes for about %.0f s "
        "before serving, then planning with them (once; --self-profile-s 0 skips this, "
        "`medha profile` times a full grid)",
        path, len(shapes), seconds,
    )  # fmt: skip
    start = time.perf_counter()
    try:
        profile = Profiler(engine).run(
            corners_first(shapes), budget_s=seconds, predictor=engine.predictor, repeats=1
        )
    except Exception as e:  # no start-up measurement ends a start (issue 68)
        if is_fatal(e):
            raise
        log.warning(
            "the start-up profile failed after %.0f s (%s: %s); planning with %s, corrected "
            "online", time.perf_counter() - start, type(e).__name__, e,
            engine.predictor.describe(),
        )  # fmt: skip
        return True  # a fresh cache, as it started
    profile.sources = ["medha serve's start-up profile"]
    if len(profile.iteration_rows) < MIN_SELF_PROFILE_ROWS:
        log.warning(
            "the start-up profile timed %d shapes in %.0f s, too few to fit; planning with "
            "%s, corrected online", len(profile.iteration_rows),
            time.perf_counter() - start, engine.predictor.describe(),
        )  # fmt: skip
        return False
    profile.save(path)
    log.warning(
        "timed %d batch shapes in %.0f s; wrote %s",
        len(profile.iteration_rows), time.perf_counter() - start, path,
    )  # fmt: skip
    return True


def probe_start(engine) -> None:
    """Time the online correction's probe shapes on `engine` (an LLMEngine being built) once
    each before serving (a lone decode, a decode batch, chunks short and long, alone, after a
    KV prefix and beside decodes: a few seconds) and correct the model with them, so that the
    defaults resolved before the first request (the TPOT target and budget, the arrival wait)
    follow this machine's speed, not a roofline 2-6x off a CPU's; every batch then corrects it
    further. At most PROBE_BUDGET_S: a shape the model, as corrected so far, says would not
    fit what is left is skipped, as is one the KV cache cannot hold; a failure leaves the
    roofline, corrected online: no start-up measurement ends a start."""
    from medha.engine.profiler import Profiler, ShapeDoesNotFit
    from medha.perf.grid import Shape

    start, profiler, cold = time.perf_counter(), Profiler(engine), True

    def measure(prefills, decodes) -> float | None:
        nonlocal cold
        left = PROBE_BUDGET_S - (time.perf_counter() - start)
        # (the first shape is a lone decode, which the roofline never prices at seconds)
        if not cold and engine.predictor.shape_time(prefills, decodes) > left:
            return None
        try:
            # one run each, the first shape's after a warm-up: the kernels are warm after
            # it, and a shape's first run then takes within 10% of its next (1.7 s of a
            # 2.8 s probe is its largest shape, 2048 tokens after 6144)
            shape = Shape(tuple(prefills), tuple(decodes))
            seconds = profiler.measure(shape, repeats=1, warm_up=cold)
        except ShapeDoesNotFit:
            return None
        cold = False
        return seconds

    try:
        timed, skipped = engine.scheduler.probe(measure)
    except Exception as e:
        if is_fatal(e):
            raise
        log.warning("the start-up probe failed (%s: %s); planning with %s, corrected "
                    "online", type(e).__name__, e, engine.predictor.describe())  # fmt: skip
        return
    log.warning(
        "no profile of this engine at %s: planning from the roofline, corrected by %d "
        "probe shapes timed in %.1f s (%d skipped) and online (--no-start-probe skips them; "
        "`medha profile` times a full grid)",
        engine.profile_path, timed, time.perf_counter() - start, skipped,
    )  # fmt: skip
