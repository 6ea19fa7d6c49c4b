"""`medha predict`: the predicted time of one batch."""

from __future__ import annotations

import argparse
import json

from medha.cli.common import CliError, add_platform_args, predictor_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="predicted time of one batch")
    add_platform_args(p, "llama-3-8b", "h100")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="TOKENS@KV",
        help="a prefill chunk of TOKENS after KV cached tokens (repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="COUNT@KV",
        help="COUNT decodes over KV cached tokens each (repeatable)",
    )
    p.set_defaults(func=run)


def _pairs(specs: list[str], flag: str) -> list[tuple[int, int]]:
    out = []
    for s in specs:
        n, _, k = s.partition("@")
        if not (n.isdigit() and (k.isdigit() or not k)) or int(n) < 1:
            raise CliError(f"{flag} {s!r}: expected TOKENS@KV_OFFSET, e.g. 512@100000")
        out.append((int(n), int(k or 0)))
    return out


def run(args: argparse.Namespace) -> None:
    predictor = predictor_from_args(args)
    prefills = _pairs(args.prefill, "--prefill")
    decodes = [k for count, k in _pairs(args.decode, "--decode") for _ in range(count)]
    if not prefills and not decodes:
        raise CliError("nothing to predict: give --prefill and/or --decode")
    total = predictor.shape_time(prefills, decodes)
    tokens = sum(n for n, _ in prefills) + len(decodes)
    result = {
        "predictor": predictor.describe(),
        "batch_time_ms": total * 1e3,
        "linear_ms": predictor.linear_time(tokens, len(prefills) + len(decodes)) * 1e3,
        "prefill_attention_ms": [predictor.prefill_attention_time(n, k) * 1e3 for n, k in prefills],
        "decode_attention_ms": sum(predictor.decode_attention_time(k) for k in decodes) * 1e3,
    }
    print(json.dumps(result, indent=1))
