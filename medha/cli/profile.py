"""`medha profile`: measure this machine's iteration times for the fitted predictor."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medha.cli.common import add_engine_choice, llm_from_args
from medha.engine.config import EngineConfig
from medha.utils.dataclass_cli import add_dataclass_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure this machine's iteration times for the fitted predictor",
        description="Time real forward passes over a grid of prefill chunks, KV "
        "offsets, decode batch sizes and KV lengths, and random mixed batches; "
        "write a profile that --predictor profiled:PATH (and the engine, by "
        "default) fits.",
    )
    p.add_argument(
        "--out",
        default=None,
        help="profile path (default: the engine's cache, "
        "~/.cache/medha/profiles/<model>-<device>.json)",
    )
    p.add_argument("--mixed", type=int, default=40, help="random mixed batches (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed batches")
    p.add_argument("--quick", action="store_true", help="a coarser grid (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_choice(p)
    add_dataclass_args(p, EngineConfig, title="engine")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from medha.engine.llm_engine import _default_profile_path
    from medha.engine.profiler import Profiler, grid

    llm = llm_from_args(args)
    engine = llm.engine
    out = args.out or _default_profile_path(engine.model_path, engine.device.type, engine.config)
    shapes = grid(
        engine.max_model_len, engine.kv_capacity_tokens, args.mixed, args.seed, quick=args.quick
    )
    print(
        f"profiling {engine.spec.name} on {engine.device.type}: {len(shapes)} batch shapes",
        file=sys.stderr,
    )
    profile = Profiler(engine, seed=args.seed).run(shapes, progress=not args.quiet)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print(
        f"wrote {out}; the engine uses it by default from now on "
        f"(or pass --predictor profiled:{out})"
    )
