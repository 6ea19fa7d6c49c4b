"""The convoy's promise over machine kinds, replayed (issue 68; tests/test_machine_kinds.py).

    python bench/sim/machine_kinds.py [--seeds 3] [--cause]

For every profile in tests/data/profiles and the reference CPUs and GPUs' rooflines: the convoy
(a 6,000-token prompt, 8 shorts of 64 tokens 0.5 s after it; medha/sim/convoy.py) with the
decisions of medha's engine (steps paused between layers where it pauses them: CPUs; planning
with the grid, or, as it starts with no profile, with the roofline corrected by its start-up
probe) and of medha's scheduler on vLLM (from no profile: the roofline corrected online;
2,048-token steps), the batches timed by the profile. The engine plans with the profile timed
again (each row off by up to 15%, --seeds of them) or with the truth scaled 0.5x and 2x; each
convoy runs after a warm-up (as the benchmarks run it) and first thing after start. Prints, per
machine and executor, the worst shorts ratio (median TTFT behind / alone), the worst long ratio
(TTFT over its time alone in the largest steps) and over its floor (that plus the shorts' own
work), and the case each came from.

--cause: the run that changes only the cause of the shorts waiting out the long prompt (issue
68, item 1): each machine-A grid with one row timed at 0.3x (and every row +-15%), fitted as
the profile fit stood before issue 68 (a free linear spline, knots between measured counts)
and as it is now (nondecreasing, Huber-weighted), the same replay for both.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from medha.perf import get_hardware, make_predictor
from medha.perf.profiled_predictor import IterationModel, iteration_features
from medha.sim.convoy import Convoy, Scaled, executor_config, grid_predictor, run_convoy

PROFILES = Path(__file__).resolve().parents[2] / "tests" / "data" / "profiles"


def fit_before_issue_68(cls, rows, num_knots: int = 12):
    """The iteration model's fit as it stood at 6cd8fdd: a linear spline through quantile knots
    (between measured counts), each coefficient >= 0 but the curve free to fall, every row
    weighed by 1/y alone."""
    from scipy.optimize import nnls

    tokens, extra = iteration_features(rows)
    knots = np.unique(np.quantile(tokens, np.linspace(0, 1, num_knots)))
    hat = np.zeros((len(tokens), len(knots)))
    xc = np.clip(tokens, knots[0], None)
    idx = np.clip(np.searchsorted(knots, xc, side="right") - 1, 0, len(knots) - 2)
    t = (xc - knots[idx]) / (knots[idx + 1] - knots[idx])
    hat[np.arange(len(tokens)), idx] = 1 - t
    hat[np.arange(len(tokens)), idx + 1] = t
    y = np.array([r.seconds for r in rows])
    a = np.hstack([hat, extra]) / y[:, None]
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    coef, _ = nnls(a / scale, np.ones(len(y)))
    coef = coef / scale
    return cls(knots, coef[: len(knots)], *coef[len(knots) :])


def with_fit(fit, make):
    """`make()` with the iteration model fitted by `fit` (None: as it is now)."""
    if fit is None:
        return make()
    original = IterationModel.fit
    IterationModel.fit = classmethod(fit)
    try:
        return make()
    finally:
        IterationModel.fit = original


def machines():
    """(name, truth, the engine's model for a seed, dtype bytes): the profiles, then rooflines."""
    for path in sorted(PROFILES.glob("*.json")):
        yield path.stem, grid_predictor(path), lambda seed, p=path: grid_predictor(p, seed), path
    for dtype in (2, 4):
        cpu = dataclasses.replace(get_hardware("cpu"), dtype_bytes=dtype)
        roof = make_predictor("roofline", "smollm2", cpu)
        yield f"reference cpu, {'bf16' if dtype == 2 else 'fp32'}", roof, lambda s, r=roof: r, None
    for gpu in ("a100", "h100", "h200"):
        roof = make_predictor("roofline", "llama-3-8b", gpu)
        yield f"{gpu} roofline, llama-3-8b", roof, lambda s, r=roof: r, "gpu"


def report(seeds: int) -> None:
    print("| machine | executor | shorts (worst) | long (worst) | long / floor (worst) | "
          "worst shorts case |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, truth, model_for, path in machines():
        # "engine, probe": the engine's default start with no profile, the roofline corrected
        # by the start-up probe (a CPU's; the GPU rows plan with their truth already)
        executors = ("engine", "vllm") if path == "gpu" else ("engine", "engine, probe", "vllm")
        for executor in executors:
            config = executor_config(executor.split(",")[0])
            if executor == "engine" and path == "gpu":
                config = executor_config("engine", pause_steps=False)  # (not on CUDA yet)
            rows = []
            for scale in (1.0, 0.5, 2.0):
                for seed in range(seeds):
                    if executor != "engine":  # from no profile: the roofline
                        dtype = 4 if "fp32" in name else 2
                        hw = dataclasses.replace(get_hardware("cpu"), dtype_bytes=dtype)
                        model = (
                            make_predictor("roofline", "smollm2", hw) if path != "gpu" else truth
                        )
                    else:
                        model = model_for(seed) if scale == 1.0 else truth
                    for warm in (True, False):
                        got = run_convoy(Scaled(truth, scale), model, config, Convoy(), seed=seed,
                                         warm=warm, probe=executor == "engine, probe")  # fmt: skip
                        rows.append((got, f"x{scale} seed {seed} {'warm' if warm else 'cold'}"))
            worst = max(rows, key=lambda r: r[0].shorts_ratio)
            print(
                f"| {name} | {executor}{'' if config.pause_steps else ', no pauses'} | "
                f"{worst[0].shorts_ratio:.2f}x | {max(r[0].long_ratio for r in rows):.2f}x | "
                f"{max(r[0].long_over_floor for r in rows):.2f}x | {worst[1]} |",
                flush=True,
            )


def cause(seeds: int) -> None:
    print("| grid | fit | shorts (worst) | long (least) | runs where the shorts waited "
          "out the long prompt (> 3x) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for path in sorted(PROFILES.glob("amx-a-*bf16.json")):
        truth = grid_predictor(path)
        for label, fit in (("before issue 68", fit_before_issue_68), ("now", None)):
            got = [
                run_convoy(
                    truth,
                    with_fit(fit, lambda p=path, s=seed: grid_predictor(p, s, outlier=0.3)),
                    executor_config("engine", pause_steps=False),
                    seed=seed,
                )
                for seed in range(seeds)
            ]
            shorts = [g.shorts_ratio for g in got]
            print(
                f"| {path.stem} | {label} | {max(shorts):.2f}x | "
                f"{min(g.long_ratio for g in got):.2f}x | "
                f"{sum(s > 3 for s in shorts)} of {len(got)} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cause", action="store_true", help="the fit before issue 68 against now")
    args = ap.parse_args()
    import os

    os.environ["MEDHA_NO_SETUP_CACHE"] = "1"  # hundreds of fits, none worth keeping
    if args.cause:
        cause(max(args.seeds, 40))
    else:
        report(args.seeds)


if __name__ == "__main__":
    main()
