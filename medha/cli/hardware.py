"""`medha hardware`: the hardware specs, this CPU measured once."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hardware", help="print the hardware specs (measures this CPU once)")
    p.add_argument("--refresh", action="store_true", help="measure this CPU again")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from medha.perf.hardware_specs import GPUS, this_cpu

    specs = {**GPUS, "cpu": this_cpu(refresh=args.refresh)}
    print(json.dumps({name: spec.to_json() for name, spec in specs.items()}, indent=1))
