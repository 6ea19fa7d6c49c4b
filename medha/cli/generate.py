"""`medha generate`: one completion with a real model."""

from __future__ import annotations

import argparse
import sys

from medha.cli.common import CliError, llm_from_args
from medha.engine.config import EngineConfig
from medha.scheduler.config import SchedulerConfig
from medha.utils.dataclass_cli import add_dataclass_args

EXTRA = "engine"  # what it needs beyond `pip install medha` (medha/extras.py)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="complete one prompt with a real model",
        description="Generate a completion with the engine (by default the "
        "embedded SmolLM2-135M-Instruct, its chat template applied).",
    )
    p.add_argument("--prompt", required=True, help="the prompt (a user message with --chat)")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the model's chat template (default: on)",
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most new tokens (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    add_dataclass_args(p, EngineConfig, title="engine")
    add_dataclass_args(p, SchedulerConfig, title="scheduler")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from medha.engine.errors import EngineError
    from medha.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or [],
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    llm = llm_from_args(args)
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate(args.prompt, params)[0]
    except (ValueError, EngineError) as e:
        raise CliError(str(e)) from None
    if out.finish_reason == "error":
        raise CliError(f"generation failed: {out.error}")
    print(out.text)
    m = out.metrics
    print(
        f"[{m['prompt_tokens']} prompt + {m['completion_tokens']} completion tokens, "
        f"finish: {out.finish_reason}, TTFT {m['ttft_s'] * 1e3:.0f} ms"
        + (f", {1 / m['tpot_s']:.1f} tokens/s" if m["tpot_s"] else "")
        + "]",
        file=sys.stderr,
    )
