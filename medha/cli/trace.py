"""`medha trace`: traces with prefix structure (Mooncake's format) for the prefix cache."""

from __future__ import annotations

import argparse
import json

from medha.cli.common import CliError
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args


def _tokens(text: str) -> int:
    """'4M' -> 4,000,000 tokens; '512K', '1.5M' and plain numbers too."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count such as 4M") from None
    if not 0 < value < 1e15:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive token count")
    return int(value)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from medha.sim.workload.prefix_trace import ConversationTraceConfig

    p = sub.add_parser(
        "trace",
        help="generate or inspect traces with prefix block hashes",
        description="Traces in Mooncake's format (JSONL: timestamp in ms, input_length, "
        "output_length, hash_ids: one prefix-chained id per 512 prompt tokens), which "
        "`medha simulate --trace FILE --prefix-cache ...` replays with its prefix cache.",
    )
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    g = tsub.add_parser(
        "generate",
        help="multi-turn conversations sharing system prompts",
        description="Generate conversations that resend their history each turn, many of "
        "them behind one of a few shared system prompts, with think time between turns.",
    )
    g.add_argument("--out", "-o", required=True, help="the trace file to write")
    g.add_argument("--format", choices=("jsonl", "csv"), default="jsonl", help="(default: jsonl)")
    add_dataclass_args(g, ConversationTraceConfig, title="conversations")
    g.set_defaults(func=run_generate)
    r = tsub.add_parser(
        "reuse",
        help="how much of a trace's prompts earlier prompts hold",
        description="Count, in arrival order, the prompt tokens whose prefix blocks some "
        "earlier request had (what an unbounded prefix cache could serve), and what LRU "
        "caches of the given capacities would hold (no timing: every earlier request "
        "counts as computed).",
    )
    r.add_argument("trace", help="bundled trace name (mooncake_conv) or a JSONL/CSV file")
    r.add_argument(
        "--capacity",
        type=_tokens,
        action="append",
        help="an LRU cache of this many tokens, e.g. 1M (repeatable; default 1M and 4M)",
    )
    r.add_argument("--json", action="store_true", help="print the counts as JSON")
    r.set_defaults(func=run_reuse)


def run_generate(args: argparse.Namespace) -> None:
    from medha.sim.workload.prefix_trace import (
        ConversationTraceConfig,
        generate_conversations,
        write_trace,
    )

    try:
        cfg = dataclass_from_args(ConversationTraceConfig, args)
    except ValueError as e:
        raise CliError(str(e)) from None
    entries = generate_conversations(cfg)
    write_trace(entries, args.out, args.format)
    tokens = sum(e.prompt_len for e in entries)
    print(f"{len(entries)} requests, {tokens} prompt tokens, in {args.out}")


def run_reuse(args: argparse.Namespace) -> None:
    from medha.sim.workload.prefix_trace import reuse_by_lru
    from medha.sim.workload.traces import TraceError, load_trace

    try:
        entries = load_trace(args.trace)
    except TraceError as e:
        raise CliError(str(e)) from None
    if any(e.hash_ids is None for e in entries):
        raise CliError(f"{args.trace}: its requests carry no hash_ids")
    out = reuse_by_lru(entries, args.capacity or [10**6, 4 * 10**6])
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{out['requests']} requests, {out['prompt_tokens']} prompt tokens")
    for key, v in out.items():
        if isinstance(v, dict):
            what = "reusable (unbounded cache)" if key == "unbounded" else f"LRU {key[4:]} tokens"
            print(f"  {what:28s} {v['hit_tokens']:>12d} tokens  {v['fraction']:6.1%}")
