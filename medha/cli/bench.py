"""`medha bench`: load-test an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys

import medha.benchmark
from medha.benchmark.config import BenchConfig
from medha.cli.common import CliError
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args

EXTRA = "route"  # what it needs beyond `pip install medha` (medha/extras.py)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server",
        description=medha.benchmark.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_dataclass_args(p, BenchConfig, title="benchmark")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _row(name: str, c: dict) -> str:
    t = c["ttft_s"]
    return (
        f"{name:6s} {c['count']:5d}  TTFT p50 {t['p50']:.3f} s  p99 {t['p99']:.3f} s"
        if c["count"] and t["p50"] is not None
        else f"{name:6s} {c['count']:5d}"
    )


def run(args: argparse.Namespace) -> None:
    from medha.benchmark.load_generator import BenchError, run_bench
    from medha.sim.workload.traces import TraceError

    try:
        cfg = dataclass_from_args(BenchConfig, args)
        summary = run_bench(cfg, progress=not args.quiet)
    except (ValueError, TraceError, BenchError) as e:
        raise CliError(str(e)) from None
    print(
        f"{summary['requests']['completed']}/{summary['requests']['total']} completed, "
        f"{summary['client']['errors']} errors, "
        f"{summary['throughput']['output_tokens_per_s']:.1f} output tokens/s"
    )
    print(_row("short", summary["by_class"]["short"]))
    print(_row("long", summary["by_class"]["long"]))
    print(f"results in {cfg.out}/", file=sys.stderr)
    if summary["client"]["errors"]:
        raise CliError(f"{summary['client']['errors']} requests failed; see {cfg.out}/requests.csv")
