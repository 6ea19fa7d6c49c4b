"""The convoy effect on this machine: one 6,000-token request, then 8 short ones.

    python bench/engine/engine_convoy.py [--policies lars,edf] [--prefix-cache device]

SmolLM2-135M on CPU. The short requests (64-token prompts, 16 output tokens) arrive 0.5 s after
the long one. Their TTFT is measured alone (no long request), behind the long one under
lars (or each of --policies) + adaptive chunking, and behind it under non-preemptive fcfs
(whole prompts). Each engine's batches are also timed against its predictor's prediction: the
median |measured / predicted - 1| over every batch from the first, and after how many batches
eight in a row were within 15% (--calibrate off: the model as it starts, a profile or the
roofline; online, the default: corrected from each batch as it runs).

    python bench/engine/engine_convoy.py --decompose [--rounds 3]

The long prompt's TTFT on the engine's defaults alone, beside the 8 shorts asking one token
each, and asking 16: what serving the shorts while it prefills costs it (issue 68).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from medha.benchmark.arrivals import drive
from medha.benchmark.step_errors import prediction_error
from medha.engine.config import EngineConfig
from medha.engine.llm_engine import LLMEngine
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import price_report


def run(
    engine: LLMEngine,
    with_long: bool,
    long_len: int,
    seed: int = 0,
    short_tokens: int = 16,
    shorts: int = 8,
) -> dict:
    rng = random.Random(seed)
    vocab = engine.runner.args.vocab_size
    short_params = SamplingParams(max_tokens=short_tokens, temperature=0, ignore_eos=True)
    arrivals = [
        (0.5, f"s{i}", [rng.randrange(3, vocab) for _ in range(64)], short_params)
        for i in range(shorts)
    ]
    if with_long:
        long_params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        arrivals.append(
            (0.0, "long", [rng.randrange(3, vocab) for _ in range(long_len)], long_params)
        )
    ttft = {rid: m["ttft_s"] for rid, m in drive(engine, arrivals).items()}
    times = [ttft[f"s{i}"] for i in range(shorts)] or [float("nan")]
    return {
        "short_p50": statistics.median(times),
        "short_max": max(times),
        "long": ttft.get("long"),
    }


def decompose(args) -> None:
    """Where the long prompt's TTFT goes on the engine with its defaults: alone, beside the 8
    shorts asking one token each (their prefill), and beside them asking 16 (their decodes
    too), alternated for --rounds rounds on one engine."""
    engine = LLMEngine(EngineConfig(model="smollm2", kernels=args.kernels, dtype=args.dtype,
                                    **args.engine),
                       SchedulerConfig(prefix_cache=args.prefix_cache))  # fmt: skip
    print(f"<!-- {price_report(engine.scheduler.config, engine.predictor)} -->")
    run(engine, True, args.long_len, seed=99)  # warm-up
    cases = {"alone": (0, 16), "shorts, 1 token": (8, 1), "shorts, 16 tokens": (8, 16)}
    got: dict[str, list[float]] = {name: [] for name in cases}
    for rnd in range(args.rounds):
        for name, (shorts, tokens) in cases.items():
            out = run(engine, True, args.long_len, seed=100 + rnd, short_tokens=tokens,
                      shorts=shorts)  # fmt: skip
            got[name].append(out["long"])
    print("| the long prompt | TTFT (median) | over alone |")
    print("|---|---|---|")
    alone = statistics.median(got["alone"])
    for name, times in got.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.2f} s ({', '.join(f'{t:.2f}' for t in times)}) | "
              f"{med / alone:.2f}x |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--long-len", type=int, default=6000)
    ap.add_argument(
        "--tpot-targets",
        default="0.125,0.25",
        help="iteration budgets (TPOT targets) for the adaptive packer, in seconds, or "
        "default: the engine's own (resolved from its model: docs/design.md)",
    )
    ap.add_argument(
        "--policies",
        default="lars",
        help="policies to run with adaptive chunking at each budget, e.g. lars,edf,srpt "
        "(edf and srpt put the short requests first: the most a scheduler can give them)",
    )
    ap.add_argument(
        "--calibrate",
        default=None,
        choices=("online", "off"),
        help="every engine's --calibrate (default: the engine's, online)",
    )
    ap.add_argument("--kernels", default="auto", help="every engine's --kernels")
    ap.add_argument("--dtype", default="auto", help="every engine's --dtype")
    ap.add_argument(
        "--prefix-cache",
        default="off",
        help="every engine's --prefix-cache (the runs alone and behind draw different prompts, "
        "so that neither hits the other's)",
    )
    ap.add_argument(
        "--engine",
        type=json.loads,
        default={},
        help="every engine's other settings (JSON EngineConfig fields), e.g. "
        "'{\"self_profile_s\": 60}' or '{\"start_probe\": false}'",
    )
    ap.add_argument("--rounds", type=int, default=3, help="--decompose's rounds")
    ap.add_argument(
        "--decompose",
        action="store_true",
        help="the long prompt's TTFT alone, beside the shorts asking one token, and asking 16: "
        "what serving them while it prefills costs it",
    )
    args = ap.parse_args()
    if args.decompose:
        decompose(args)
        return
    cache = args.prefix_cache
    targets = [None if t == "default" else float(t) for t in args.tpot_targets.split(",")]
    configs = [
        (
            f"{p} + adaptive, " + ("defaults" if t is None else f"TPOT {t * 1e3:.0f} ms"),
            SchedulerConfig(policy=p, tpot_target_s=t, prefix_cache=cache),
        )
        for t in targets
        for p in args.policies.split(",")
    ]
    configs.append(
        (
            "fcfs, no chunking",
            SchedulerConfig(policy="fcfs", chunking="none", prefix_cache=cache),
        )
    )
    print("| scheduler | short TTFT p50 alone | p50 behind the long one | max behind | long TTFT |")
    print("|---|---|---|---|---|")
    results, accuracy = {}, {}
    for name, cfg in configs:
        engine = LLMEngine(
            EngineConfig(
                model="smollm2",
                calibrate=args.calibrate,
                kernels=args.kernels,
                dtype=args.dtype,
                **args.engine,
            ),
            cfg,
        )
        engine.metrics.keep_samples = True
        print(f"<!-- {name}: {engine.predictor.describe()}; "
              f"{price_report(engine.scheduler.config, engine.predictor)} -->")  # fmt: skip
        run(engine, False, args.long_len, seed=1)  # warm-up
        alone = run(engine, False, args.long_len)
        behind = run(engine, True, args.long_len, seed=0 if cache == "off" else 2)
        results[name] = (alone, behind)
        print(
            f"| {name} | {alone['short_p50']:.3f} s | {behind['short_p50']:.3f} s | "
            f"{behind['short_max']:.3f} s | {behind['long']:.1f} s |"
        )
        accuracy[name] = prediction_error([(m, p) for *_, m, p in engine.metrics.samples])
    print(f"\npredicted batch times (--calibrate {engine.config.calibrate}):")
    for name, (median, n, settled) in accuracy.items():
        when = f"after {settled} batches" if settled is not None else "never"
        print(f"  {name}: median |measured / predicted - 1| {median:.3f} over {n} batches; "
              f"eight in a row within 15% {when}")  # fmt: skip
    fcfs = results.pop("fcfs, no chunking")
    # No scheduler gets a short request's TTFT below its time alone, so fcfs's own convoy
    # bounds the ratio any scheduler can show against it.
    print(
        f"\nfcfs behind / alone = {fcfs[1]['short_p50'] / fcfs[0]['short_p50']:.1f}x: "
        "the most any scheduler can gain over fcfs here"
    )
    for name, (alone, behind) in results.items():
        print(
            f"\n{name}: behind / alone = {behind['short_p50'] / alone['short_p50']:.2f}x "
            f"(goal <= 2x); fcfs / {name.split()[0]} behind the long one = "
            f"{fcfs[1]['short_p50'] / behind['short_p50']:.1f}x (goal >= 10x)"
        )


if __name__ == "__main__":
    main()
