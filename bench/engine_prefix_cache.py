"""Multi-turn conversations with and without the prefix cache, on medha's engine.

    python bench/engine_prefix_cache.py [--conversations 20] [--max-history 6000]

SmolLM2-135M on CPU. Each conversation grows turn by turn: a turn's prompt is the previous
prompt, the previous answer (16 greedy tokens) and a new message of 50-500 tokens, until the
history passes --max-history tokens. Two engines run side by side in this process, one with
`--prefix-cache device` and one with it off, each request alone, alternating which goes first.
Prints, per conversation, whether every answer is token-identical, and the TTFT of late turns
(history of at least --late tokens) with and without the cache, and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from medha.core.config import SchedulerConfig
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--max-history", type=int, default=6000)
    ap.add_argument("--late", type=int, default=4000, help="a late turn's history, in tokens")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mode", default="device", help="the cached engine's --prefix-cache")
    ap.add_argument(
        "--chunking",
        default="adaptive",
        help="the cached engine's chunking; with --mode off, a control: the same engine with "
        "other chunk boundaries (how much the dtype's rounding alone changes answers)",
    )
    args = ap.parse_args()

    def engine(mode: str, chunking: str = "adaptive") -> LLM:
        return LLM(
            scheduler=SchedulerConfig(prefix_cache=mode, chunking=chunking), dtype=args.dtype
        )

    engines = {"cache": engine(args.mode, args.chunking), "no cache": engine("off")}
    vocab = engines["cache"].engine.runner.args.vocab_size
    rng = random.Random(0)
    identical, late = 0, {"cache": [], "no cache": []}
    turns_total = 0
    for c in range(args.conversations):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(50, 500))]
        same, turn, first_diff = True, 0, None
        while len(prompt) <= args.max_history:
            order = list(engines) if (c + turn) % 2 else list(engines)[::-1]
            outs = {}
            for name in order:
                outs[name] = engines[name].generate([prompt], GREEDY)[0]
            if len(prompt) >= args.late:
                for name, out in outs.items():
                    late[name].append(out.metrics["ttft_s"])
            answer = outs["no cache"].token_ids
            if same and outs["cache"].token_ids != answer:
                same, first_diff = False, turn
            prompt = (
                prompt + answer + [rng.randrange(3, vocab) for _ in range(rng.randint(50, 500))]
            )
            turn += 1
        turns_total += turn
        identical += same
        print(
            f"conversation {c:2d}: {turn} turns, last prompt {len(prompt) - 16:5d} tokens, "
            f"{'identical' if same else f'DIFFERENT from turn {first_diff}'}",
            flush=True,
        )
    stats = engines["cache"].engine.stats()
    print(f"\n{identical}/{args.conversations} conversations token-identical ({turns_total} turns)")
    if late["cache"]:
        with_cache, without = statistics.median(late["cache"]), statistics.median(late["no cache"])
        p90 = {
            k: statistics.quantiles(v, n=10)[-1] if len(v) > 1 else v[0] for k, v in late.items()
        }
        print(
            f"late turns (history >= {args.late} tokens, {len(late['cache'])} of them): median "
            f"TTFT {with_cache:.3f} s with the cache, {without:.3f} s without: "
            f"{without / with_cache:.1f}x lower (p90 {p90['cache']:.3f} s vs "
            f"{p90['no cache']:.3f} s)"
        )
    else:
        print(f"no late turns (no history reached {args.late} tokens)")
    print(
        f"prefix cache: {stats.prefix_hit_tokens}/{stats.prefix_query_tokens} prompt tokens "
        f"served ({stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens):.1%})"
    )
    sys.exit(0 if identical == args.conversations else 1)


if __name__ == "__main__":
    main()
