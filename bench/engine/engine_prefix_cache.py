"""Multi-turn conversations with and without the prefix cache, on medha's engine.

    python bench/engine/engine_prefix_cache.py [--conversations 20] [--max-history 6000]
    python bench/engine/engine_prefix_cache.py --compare outputs --answer-tokens 128

SmolLM2-135M on CPU. Each conversation grows turn by turn: a turn's prompt is the previous
prompt, the previous answer (--answer-tokens greedy tokens, 16 by default) and a new message of
50-500 tokens, until the history passes --max-history tokens. Two engines run side by side in
this process, each request alone, alternating which goes first:

- `--compare off` (the default): one with `--prefix-cache device` (--mode) and one with it off;
  the next turn repeats the uncached engine's answer.
- `--compare outputs`: both with `--prefix-cache device`, one caching the blocks of finished
  answers (the default) and one prompts only (`--no-prefix-cache-outputs`); each conversation
  continues with each engine's own answer (the same in float32; in bf16 they may drift apart,
  and a next turn must repeat the engine's own answer for it to be found), with the same new
  messages, so that the prompts have the same lengths.

Prints, per conversation, whether every answer is token-identical, and the TTFT of late turns
(history of at least --late tokens) of both engines and their ratio, and the share of prompt
tokens each engine's cache served.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--max-history", type=int, default=6000)
    ap.add_argument("--late", type=int, default=4000, help="a late turn's history, in tokens")
    ap.add_argument("--answer-tokens", type=int, default=16, help="greedy tokens per answer")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--compare",
        choices=("off", "outputs"),
        default="off",
        help="off: the cache against none; outputs: cached answers against prompts only",
    )
    ap.add_argument("--mode", default="device", help="the cached engine's --prefix-cache")
    ap.add_argument(
        "--chunking",
        default="adaptive",
        help="the cached engine's chunking; with --mode off, a control: the same engine with "
        "other chunk boundaries (how much the dtype's rounding alone changes answers)",
    )
    args = ap.parse_args()
    greedy = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)

    def engine(mode: str, chunking: str = "adaptive", outputs: bool = True) -> LLM:
        config = SchedulerConfig(prefix_cache=mode, chunking=chunking, prefix_cache_outputs=outputs)
        return LLM(scheduler=config, dtype=args.dtype)

    if args.compare == "outputs":
        engines = {
            "answers cached": engine(args.mode, args.chunking),
            "prompts only": engine(args.mode, args.chunking, outputs=False),
        }
    else:
        engines = {"cache": engine(args.mode, args.chunking), "no cache": engine("off")}
    first, ref = engines  # the engine measured, and the reference
    vocab = engines[first].engine.runner.args.vocab_size
    rng = random.Random(0)
    identical, late = 0, {name: [] for name in engines}
    turns_total = 0
    for c in range(args.conversations):
        start = [rng.randrange(3, vocab) for _ in range(rng.randint(50, 500))]
        prompts = dict.fromkeys(engines, start)
        same, turn, first_diff = True, 0, None
        while len(prompts[ref]) <= args.max_history:
            order = list(engines) if (c + turn) % 2 else list(engines)[::-1]
            outs = {}
            for name in order:
                outs[name] = engines[name].generate([prompts[name]], greedy)[0]
            if len(prompts[ref]) >= args.late:
                for name, out in outs.items():
                    late[name].append(out.metrics["ttft_s"])
            if same and outs[first].token_ids != outs[ref].token_ids:
                same, first_diff = False, turn
            message = [rng.randrange(3, vocab) for _ in range(rng.randint(50, 500))]
            for name in engines:
                # each engine's own answer with --compare outputs, the reference's otherwise
                answer = outs[name if args.compare == "outputs" else ref].token_ids
                prompts[name] = prompts[name] + answer + message
            turn += 1
        turns_total += turn
        identical += same
        print(
            f"conversation {c:2d}: {turn} turns, last prompt "
            f"{len(prompts[ref]) - args.answer_tokens:5d} tokens, "
            f"{'identical' if same else f'DIFFERENT from turn {first_diff}'}",
            flush=True,
        )
    print(f"\n{identical}/{args.conversations} conversations token-identical ({turns_total} turns)")
    if late[first]:
        a, b = statistics.median(late[first]), statistics.median(late[ref])
        p90 = {
            k: statistics.quantiles(v, n=10)[-1] if len(v) > 1 else v[0] for k, v in late.items()
        }
        print(
            f"late turns (history >= {args.late} tokens, {len(late[first])} of them): median "
            f"TTFT {a:.3f} s {first}, {b:.3f} s {ref}: {b / a:.2f}x lower (p90 "
            f"{p90[first]:.3f} s vs {p90[ref]:.3f} s)"
        )
    else:
        print(f"no late turns (no history reached {args.late} tokens)")
    for name, llm in engines.items():
        stats = llm.engine.stats()
        if stats.prefix_query_tokens:
            print(
                f"prefix cache, {name}: {stats.prefix_hit_tokens}/{stats.prefix_query_tokens} "
                f"prompt tokens served "
                f"({stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens):.1%})"
            )
    sys.exit(0 if identical == args.conversations else 1)


if __name__ == "__main__":
    main()
