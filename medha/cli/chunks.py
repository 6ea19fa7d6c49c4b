"""`medha chunks`: the chunk sizes adaptive chunking picks for one long prompt."""

from __future__ import annotations

import argparse

from medha.cli.common import CliError, add_platform_args, predictor_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chunks", help="chunk sizes adaptive chunking picks for one long prompt")
    add_platform_args(p, "llama-3-8b", "h100", tp=8)
    p.add_argument(
        "--prompt-len", type=int, default=1_000_000, help="prompt tokens (default: 1000000)"
    )
    p.add_argument(
        "--iteration-budget-s",
        type=float,
        default=0.05,
        help="iteration time budget in seconds, as the scheduler's "
        "--iteration-budget-s (default: 0.05)",
    )
    p.add_argument("--chunking", default="adaptive", help="adaptive | static:N | none")
    p.add_argument("--all", action="store_true", help="print every chunk, not a sample")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from medha.scheduler.config import SchedulerConfig
    from medha.scheduler.packers import make_packer

    predictor = predictor_from_args(args)
    if args.prompt_len < 1:
        raise CliError(f"--prompt-len must be positive, got {args.prompt_len}")
    try:
        config = SchedulerConfig(chunking=args.chunking, iteration_budget_s=args.iteration_budget_s)
    except ValueError as e:
        raise CliError(str(e)) from None
    packer = make_packer(config, predictor)
    chunks, k, total = [], 0, 0.0
    while k < args.prompt_len:
        n = packer.plan_isolated(k, args.prompt_len - k)
        t = predictor.shape_time([(n, k)])
        chunks.append((k, n, t))
        total += t
        k += n
    print(
        f"{predictor.describe()}; chunking {args.chunking}, iteration budget "
        f"{packer.iteration_budget_s * 1e3:g} ms"
    )
    print(f"{'kv offset':>10s} {'chunk':>7s} {'predicted ms':>13s}")
    step = 1 if args.all else max(1, len(chunks) // 20)
    shown = list(range(0, len(chunks), step))
    if shown[-1] != len(chunks) - 1:
        shown.append(len(chunks) - 1)
    for i in shown:
        kv, n, t = chunks[i]
        print(f"{kv:10d} {n:7d} {t * 1e3:13.2f}")
    print(
        f"{len(chunks)} chunks, {args.prompt_len} tokens, predicted prefill time "
        f"{total:.2f} s (chunks run back to back)"
    )
