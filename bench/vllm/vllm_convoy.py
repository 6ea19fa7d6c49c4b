"""The convoy effect on vLLM's engine: plain vLLM's scheduler against medha's, through vLLM's
OpenAI server, side by side in one run.

    python bench/vllm/vllm_convoy.py [--rounds 2] [--medha '{"policy": "lars", ...}' ...] \
        [--front vllm]

SmolLM2-135M on this machine, every server with the same flags
(medha/benchmark/vllm_servers.py: vLLM's dtype, 2,048 tokens and 128 sequences per step). A
6,000-token prompt, then 8 short prompts (64 tokens, 16 output tokens each) 0.5 s later; and 8
short prompts alone (--alone-runs runs, each of other prompts: the median). For each server,
the short requests' TTFT p50 alone and behind the long prompt, their ratio, and the long
prompt's TTFT; over the rounds, each one's largest shorts ratio over its smallest (issue 68:
the same promise on every start); for each medha contender, how far its
predicted step times were from the measured ones, every step from the server's first (the
scheduler's MEDHA_STEP_LOG; the default `calibrate: online` corrects the model as it runs,
`"calibrate": "off"` in --medha keeps it as it starts).
Contenders: `python -m vllm.entrypoints.openai.api_server` with its default scheduler (and, with
--peer or --tuned-peers, with vLLM's own convoy flags as a user tunes them), and the same with
`--scheduler-cls medha.vllm_executor.MedhaScheduler --additional-config
'{"medha": ...}'` (or, with --front medha, `medha serve --engine vllm`); with --engine-medha,
`medha serve` on medha's own engine; one server at a time, alternated for --rounds rounds.
With --decoding N, N requests are already decoding when the long prompt arrives (1 s after
them), instead of the shorts: the gaps between their streamed tokens while it prefills, p99 and
the largest, against the same streams alone (the Medha paper's TBT under a long prefill);
--long-tokens sets the long prompt's length (8,000: SmolLM2's longest; longer with
--max-model-len and --model, a copy of SmolLM2 whose config.json allows a longer context: timing
needs no trained weights).
With tuned peers, a last table gives each contender's medians (long TTFT over plain vLLM's of
the same round, shorts behind / alone) and its Pareto front: whether some vLLM setting beats a
medha contender on both at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

from medha.benchmark.harness import dominates, pareto_front, percentile
from medha.benchmark.local_server import alternated, local_server
from medha.benchmark.step_errors import prediction_error, read_step_log
from medha.benchmark.vllm_servers import (
    add_contender_args,
    add_server_args,
    contenders,
    server_env,
    server_flags,
)


async def ttft(client, prompt: list[int], delay: float, t0: float, tokens: int = 16) -> float:
    """Time from the request's arrival (t0 + delay) to its first streamed token."""
    await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
    sent = time.monotonic()
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic() - sent
    return first if first is not None else float("nan")


async def scenario(
    url: str, with_long: bool, seed: int, short_tokens: int = 16, long_tokens: int = 6000
) -> dict:
    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
    shorts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(8)]
    long = [rng.randrange(100, 40000) for _ in range(long_tokens)]
    t0 = time.monotonic()
    tasks = [ttft(client, p, 0.5, t0, short_tokens) for p in shorts]
    if with_long:
        tasks.append(ttft(client, long, 0.0, t0))
    times = await asyncio.gather(*tasks)
    await client.close()
    out = {"short_p50": statistics.median(times[:8]), "short_max": max(times[:8])}
    if with_long:
        out["long"] = times[8]
    return out


async def decoding(url: str, streams: int, with_long: bool, seed: int, long_tokens: int) -> dict:
    """`streams` requests decoding (64-token prompts, EOS ignored) and, 1 s after they start, a
    `long_tokens` prompt: every gap between two streamed chunks of a decoding request that
    overlaps the window from the long prompt's arrival to its first token (alone: 3 s from the
    same moment), p99 and the largest; the long prompt's TTFT."""
    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
    prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(streams)]
    long = [rng.randrange(100, 40000) for _ in range(long_tokens)]
    done = asyncio.Event()

    async def stream(prompt: list[int]) -> list[float]:
        times = []
        response = await client.completions.create(
            model="m", prompt=prompt, max_tokens=2048, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in response:
            if chunk.choices:
                times.append(time.monotonic())
            if done.is_set():
                break
        await response.close()
        return times

    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(stream(p)) for p in prompts]
    start = t0 + 1.0
    if with_long:
        long_ttft = await ttft(client, long, 1.0, t0)  # (returns once its 16 tokens are in)
        end = start + long_ttft
    else:
        long_ttft, end = float("nan"), start + 3.0
        await asyncio.sleep(max(0.0, end - time.monotonic()))
    done.set()
    times = await asyncio.gather(*tasks)
    await client.close()
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > start and a < end]
    return {"p99": percentile(gaps, 99), "max": max(gaps), "long": long_ttft}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--short-tokens",
        type=int,
        default=16,
        help="output tokens of each short prompt (1: their decodes cost the long prompt "
        "nothing, the convoy's TTFTs without them)",
    )
    ap.add_argument(
        "--decoding",
        type=int,
        default=0,
        metavar="N",
        help="instead of the shorts: N requests already decoding when the long prompt arrives; "
        "their gaps between streamed tokens while it prefills (p99, the largest) against the "
        "same streams alone, and the long prompt's TTFT",
    )
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=6000,
        help="the long prompt's tokens (default 6,000; at most --max-model-len)",
    )
    ap.add_argument(
        "--alone-runs",
        type=int,
        default=3,
        help="runs of the 8 shorts alone, each with its own prompts; their time alone is the "
        "median of the runs' p50s (default 3: a single run's p50 varied 0.13-0.27 s between "
        "starts of one server on a 2-core Xeon, which alone moved a ratio by 2x)",
    )
    ap.add_argument("--verbose", action="store_true", help="the servers' logs")
    add_server_args(ap)
    add_contender_args(ap)
    args = ap.parse_args()
    for flag in ("rounds", "alone_runs"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    flags = server_flags(args)
    servers = contenders(args, flags)
    peers = [n for n, c in servers.items() if c.peer]
    rows, errors = [], []
    what = "decodes' gap p99" if args.decoding else "short TTFT p50"
    logs = tempfile.mkdtemp(prefix="vllm-convoy-steps-")
    print(f"medha's step logs (MEDHA_STEP_LOG) in {logs}", file=sys.stderr)
    for rnd, name in alternated(list(servers), args.rounds):
        contender = servers[name]
        step_log = os.path.join(logs, f"{rnd}-{len(rows)}.jsonl")
        env = server_env(args, contender, step_log)
        with local_server(contender.command, quiet=not args.verbose, env=env) as url:
            asyncio.run(scenario(url, False, 99))  # warm-up
            # (the runs alone and behind draw different prompts: every server here caches
            # prefixes, and shorts it had seen alone would be served from the cache behind)
            n, size, out = args.decoding, args.long_tokens, args.short_tokens
            if n:
                a = asyncio.run(decoding(url, n, False, rnd, size))
                b = asyncio.run(decoding(url, n, True, 1000 + rnd, size))
                alone, behind = {"p": a["p99"]}, {"p": b["p99"], "max": b["max"]}
            else:
                # (alone: the median of --alone-runs runs, each with prompts of its own)
                runs = [
                    asyncio.run(scenario(url, False, 100 * i + rnd, out, size))["short_p50"]
                    for i in range(args.alone_runs)
                ]
                b = asyncio.run(scenario(url, True, 1000 + rnd, out, size))
                alone, behind = {"p": statistics.median(runs)}, {"p": b["short_p50"]}
                behind["max"] = b["short_max"]
                print(
                    f"round {rnd} {name}: shorts alone, each run "
                    + ", ".join(f"{t:.3f}" for t in runs) + " s",
                    file=sys.stderr,
                )  # fmt: skip
            behind["long"] = b["long"]
        if contender.medha is not None and os.path.exists(step_log):
            errors.append((name, rnd, *prediction_error(read_step_log(step_log))))
        rows.append((name, rnd, alone["p"], behind["p"], behind["max"], behind["long"]))
        print(
            f"round {rnd} {name}: {what} alone {alone['p']:.3f} s, behind {behind['p']:.3f} s "
            f"({behind['p'] / alone['p']:.1f}x), long TTFT {behind['long']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"\n{flags}; front {args.front}; plain vLLM bound to "
        f"{args.plain_bind or args.bind or 'its default'}, medha on vLLM to "
        f"{args.bind or 'its default'}\n"
    )
    print(f"| round | scheduler | {what} alone | behind the long one | ratio | max behind "
          "| long TTFT |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, rnd, alone, behind, worst, long in rows:
        print(
            f"| {rnd} | {name} | {alone:.3f} s | {behind:.3f} s | {behind / alone:.2f}x | "
            f"{worst:.3f} s | {long:.2f} s |"
        )
    print()
    print("| round | scheduler | median abs(measured / predicted - 1), every step from the "
          "first | steps | 8 in a row within 15% after |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, rnd, median, count, settled in errors:
        after = "never" if settled is None else f"{settled} steps"
        print(f"| {rnd} | {name} | {median:.3f} | {count} | {after} |")
    print()
    for rnd in range(0 if args.decoding else args.rounds):  # (the shorts' goals)
        plain = next(r for r in rows if r[1] == rnd and r[0] == "vLLM")
        for ours in (r for r in rows if r[1] == rnd and r[0] not in ("vLLM", *peers)):
            goal = 1.10 if servers[ours[0]].engine else 1.15
            print(
                f"round {rnd} {ours[0]}: shorts behind / alone {ours[3] / ours[2]:.2f}x (goal "
                f"<= 1.5x), long TTFT / plain vLLM's {ours[5] / plain[5]:.2f}x (goal <= "
                f"{goal:.2f}x)"
            )
    if not args.decoding and args.rounds > 1:  # (issue 68: the same promise on every start)
        for name in dict.fromkeys(r[0] for r in rows):
            ratios = [r[3] / r[2] for r in rows if r[0] == name]
            spread = max(ratios) / min(ratios)
            print(
                f"{name}: shorts behind / alone {min(ratios):.2f}-{max(ratios):.2f}x over "
                f"{len(ratios)} starts, the largest over the smallest {spread:.2f}"
            )
    if peers:
        medha = [n for n, c in servers.items() if c.medha is not None]
        pareto(rows, medha, args.decoding > 0)


def pareto(rows: list[tuple], medha: list[str], decoding: bool = False) -> None:
    """Each contender's medians over the rounds (long TTFT over plain vLLM's of the same round;
    shorts behind / alone, or with `decoding` the decodes' gap p99 behind), whether it is on
    the Pareto front, and for each medha contender the vLLM settings that beat it on both at
    once (the issue's test: none should)."""
    plain = {r[1]: r[5] for r in rows if r[0] == "vLLM"}
    points = {}
    for name in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == name]
        points[name] = (
            statistics.median(r[5] / plain[r[1]] for r in mine),
            statistics.median(r[3] if decoding else r[3] / r[2] for r in mine),
        )
    front = pareto_front(points)
    other = "decodes' gap p99" if decoding else "shorts behind / alone"
    print(f"\n| contender | long TTFT / plain vLLM's (median) | {other} (median) | on the "
          "Pareto front |")  # fmt: skip
    print("|---|---|---|---|")
    unit = " s" if decoding else "x"
    for name, p in sorted(points.items(), key=lambda kv: kv[1]):
        on = "yes" if name in front else ""
        print(f"| {name} | {p[0]:.2f}x | {p[1]:.3f}{unit} | {on} |")
    vllm = [v for v in points if v not in medha]  # (vLLM + medha is a medha contender)
    for name in medha:
        better = [v for v in vllm if dominates(points[v], points[name])]
        print(f"{name}: beaten on both by {', '.join(better) or 'no vLLM setting'}")


if __name__ == "__main__":
    main()
