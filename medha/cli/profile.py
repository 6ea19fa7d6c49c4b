"""`medha profile`: measure this machine's iteration times for the fitted predictor."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medha.cli.common import CliError, add_engine_choice, llm_from_args, scheduler_config_from_args
from medha.engine.config import EngineConfig
from medha.scheduler.config import SchedulerConfig
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args, flags

# the scheduler's limits that shape what is profiled (the rest of its flags do not matter here)
_LIMITS = ("max_model_len", "max_num_seqs", "max_batch_tokens")

EXTRA = "engine"  # what it needs beyond `pip install medha` (medha/extras.py)


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
        "~/.cache/medha/profiles/<model>-<device>-<dtype>[-vllmkernels][-tpN-sppN-kvpN].json; "
        "with --engine vllm "
        "<model>-vllm-<device>-<dtype>.json, which medha's scheduler on vLLM then plans with)",
    )
    p.add_argument("--mixed", type=int, default=40, help="random mixed batches (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed batches")
    p.add_argument("--quick", action="store_true", help="a coarser grid (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_choice(p)
    add_dataclass_args(p, EngineConfig, title="engine")
    add_dataclass_args(
        p,
        SchedulerConfig,
        skip=tuple(f.name for f in flags(SchedulerConfig) if f.name not in _LIMITS),
        title="limits (with --engine vllm: serve with the same ones; --max-batch-tokens "
        "defaults to 2048 there)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        _profile_vllm(args)
        return
    if args.vllm_arg:
        raise CliError("--vllm-arg needs --engine vllm")
    from medha.engine.profiler import Profiler
    from medha.perf.grid import grid

    llm = llm_from_args(args, self_profile_s=0)  # this command is the profile
    engine = llm.engine
    out = args.out or engine.profile_path
    shapes = grid(
        engine.max_model_len,
        engine.kv_capacity_tokens,
        args.mixed,
        args.seed,
        quick=args.quick,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
    )
    print(
        f"profiling {engine.spec.name} on {engine.device.type}: {len(shapes)} batch shapes",
        file=sys.stderr,
    )
    profile = Profiler(engine, seed=args.seed).run(shapes, progress=not args.quiet)
    profile.save(out)
    if Path(out).resolve() == Path(engine.profile_path).resolve():
        print(
            f"wrote {out}; the engine uses it by default from now on "
            f"(or pass --predictor profiled:{out})"
        )
    else:  # the engine looks for its profile at profile_path only
        print(f"wrote {out}; pass --predictor profiled:{out} to use it")


def _profile_vllm(args: argparse.Namespace) -> None:
    try:
        from medha.vllm_executor.engine_args import parse_vllm_args
        from medha.vllm_executor.profiler import profile_vllm
        from medha.vllm_executor.settings import vllm_profile_path
    except ImportError as e:
        raise CliError(str(e)) from None
    from medha.engine.errors import EngineError

    if args.mixed != 40:
        raise CliError("--mixed applies to --engine medha (vLLM's profile runs two mixed loads)")
    try:
        engine = dataclass_from_args(EngineConfig, args)
        profile, report, profiler = profile_vllm(
            engine,
            scheduler_config_from_args(args),
            parse_vllm_args(args.vllm_arg),
            seed=args.seed,
            quick=args.quick,
            progress=not args.quiet,
        )
    except (EngineError, ValueError) as e:
        raise CliError(str(e)) from None
    out = args.out or vllm_profile_path(
        profiler.model, profiler.device, profiler.dtype, profiler.tp
    )
    profile.save(out)
    print(
        f"{report['steps']} steps (the model in vLLM's {report['executor']} executor) in "
        f"{report['wall_s']:.0f} s ({report['dropped']} dropped as "
        f"slowed by the machine); fit error median {report['fit_median']:.1%}, p90 "
        f"{report['fit_p90']:.1%}; on held-out steps median {report['holdout_median']:.1%}, "
        f"p90 {report['holdout_p90']:.1%}"
    )
    print(
        f"wrote {out}; medha's scheduler on vLLM ({profiler.dtype}) plans with it by default "
        f"from now on (or pass --predictor profiled:{out})"
    )
