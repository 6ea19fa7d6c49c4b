"""`medha demo`: the convoy effect and how the schedulers handle it, on predicted batch times.

One long prompt lands among a stream of short chat requests. Each configuration runs the same
request list through the real scheduler; batch times come from the predictor (by default the
embedded SmolLM2-135M on this machine's CPU, measured once).
"""

from __future__ import annotations

import argparse

from medha import __version__
from medha.cli.common import add_platform_args, predictor_from_args, scheduler_config_from_args
from medha.scheduler.config import SchedulerConfig
from medha.utils.dataclass_cli import add_dataclass_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="compare schedulers on a long prompt among short ones",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_platform_args(p, "smollm2", "cpu")
    g = p.add_argument_group("workload")
    g.add_argument("--num-short", type=int, default=40, help="short requests (default: 40)")
    g.add_argument(
        "--short-qps",
        type=float,
        default=1.0,
        help="arrival rate of short requests per second (default: 1.0)",
    )
    g.add_argument(
        "--long-prompt", type=int, default=6000, help="tokens of the long prompt (default: 6000)"
    )
    g.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    g.add_argument(
        "--kv-memory-gb",
        type=float,
        default=2.0,
        help="KV cache memory per device in GiB (default: 2)",
    )
    add_dataclass_args(p, SchedulerConfig, skip=("policy", "chunking"), title="scheduler")
    p.set_defaults(func=run, tpot_target_s=0.125)


def run(args: argparse.Namespace) -> None:
    from medha.demo import DemoWorkload, demo_table
    from medha.scheduler.block_manager import BlockManager
    from medha.scheduler.config_defaults import resolve_config

    predictor = predictor_from_args(args)
    base = resolve_config(scheduler_config_from_args(args), predictor)
    workload = DemoWorkload(
        num_short=args.num_short,
        short_qps=args.short_qps,
        long_prompt=args.long_prompt,
        seed=args.seed,
    )
    blocks = BlockManager.from_memory(
        args.kv_memory_gb * 2**30,
        predictor.model,
        predictor.parallel,
        predictor.hardware.dtype_bytes,
    )
    print(f"medha {__version__} scheduling demo: {predictor.describe()}")
    print(
        f"one {workload.long_prompt}-token prompt at t={workload.long_at_s:.0f}s among "
        f"{workload.num_short} short chat requests ({workload.short_qps}/s); iteration "
        f"budget {base.iteration_budget_s * 1e3:.0f} ms; batch times "
        "predicted, not measured\n"
    )
    print(demo_table(predictor, workload, base, blocks.num_blocks))
