"""`medha analyze`: analytic models of scheduling policies."""

from __future__ import annotations

import argparse

from medha.analysis.cli_analyze import DESCRIPTION, DeferredPrefillArgs
from medha.cli.common import CliError, add_platform_args, predictor_from_args
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="analytic models of scheduling policies",
        description="Analytic models of scheduling policies, beside the simulator's numbers.",
    )
    models = p.add_subparsers(dest="model_name", metavar="MODEL", required=True)
    q = models.add_parser(
        "deferred-prefill",
        help="throughput over the departure threshold K",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_platform_args(q, "llama-3-8b", "h100")
    add_dataclass_args(q, DeferredPrefillArgs, title="system and curve")
    q.set_defaults(func=run_deferred_prefill)


def run_deferred_prefill(args: argparse.Namespace) -> None:
    from medha.analysis.cli_analyze import analyze
    from medha.sim.config import ClusterConfig

    predictor = predictor_from_args(args)
    try:
        options = dataclass_from_args(DeferredPrefillArgs, args)
        cluster = ClusterConfig(model=args.model, hardware=args.hardware, predictor=args.predictor)
        print(analyze(options, predictor, cluster, predictor.parallel))
    except ValueError as e:
        raise CliError(str(e)) from None
