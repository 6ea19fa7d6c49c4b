"""Predictor error on real iterations of this machine that the profile never saw.

    python bench/engine/engine_predictor.py [--profile PATH] [--held-out 40]

Profiles the engine (or loads --profile, as written by `medha profile`), fits the profiled
predictor, then measures --held-out random mixed batches (prefill chunks beside decodes, a
different seed from the profile's) and compares. The roofline model of the measured CPU is
scored on the same batches.
"""

from __future__ import annotations

import argparse

import numpy as np

from medha.benchmark.harness import percentile
from medha.engine.llm_engine import EngineConfig, LLMEngine
from medha.engine.profiler import Profiler
from medha.perf import ParallelConfig, make_predictor
from medha.perf.grid import grid, random_mixed
from medha.perf.profile_data import load_profile
from medha.perf.profiled_predictor import ProfiledPredictor


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profile", default=None, help="a profile from `medha profile`")
    ap.add_argument("--held-out", type=int, default=40)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model="smollm2", predictor="roofline"))
    profiler = Profiler(engine, seed=1)
    max_len = engine.scheduler.max_model_len
    capacity = engine.scheduler.blocks.capacity_tokens
    if args.profile:
        profile = load_profile(args.profile)
    else:
        profile = profiler.run(grid(max_len, capacity, mixed=40, seed=0))
    fitted = ProfiledPredictor(engine.spec, engine.predictor.hardware, ParallelConfig(), profile)
    roofline = make_predictor("roofline", engine.spec, engine.predictor.hardware)
    shapes = random_mixed(args.held_out, max_len, capacity, seed=12345)
    errors = {"profiled": [], "roofline": []}
    for shape in shapes:
        measured = profiler.measure(shape)
        for name, pred in (("profiled", fitted), ("roofline", roofline)):
            errors[name].append(
                abs(pred.shape_time(shape.prefills, shape.decode_kv) - measured) / measured
            )
    print(
        f"{len(profile.iteration_rows)} profiled iterations, {len(shapes)} held-out mixed batches\n"
    )
    print("| predictor | median error | P95 error | max |")
    print("|---|---|---|---|")
    for name, e in errors.items():
        print(f"| {name} | {np.median(e):.1%} | {percentile(e, 95):.1%} | {max(e):.1%} |")


if __name__ == "__main__":
    main()
