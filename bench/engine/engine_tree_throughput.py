"""Engine throughput of two source trees side by side (a refactor's before and after).

    python bench/engine/engine_tree_throughput.py --model DIR --trees BEFORE AFTER [--device cuda]
        [--rounds 3] [--only fcfs]

The workload and the two schedulers of bench/engine/engine_throughput.py (64 requests, prompts of
64-512 random tokens, 64-256 output tokens, max_num_seqs 64, float32), after a warm-up of 4
requests. Each tree (a folder holding its `medha` package, e.g. a `git worktree`) runs in its
own process, BEFORE and AFTER alternated round by round; prints tokens per second per run and
the medians. DIR: any Llama checkpoint; a small one weighs the engine's own work most.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def child(model: str, device: str, only: str) -> None:
    """One tree's run (this process imports that tree's medha)."""
    from medha.engine.llm import LLM
    from medha.engine.sampling_params import SamplingParams
    from medha.scheduler.config import SchedulerConfig

    rng = random.Random(0)  # as medha.benchmark.hf_baselines.make_workload draws them
    requests = []
    for _ in range(64):
        prompt_len, output_len = rng.randint(64, 512), rng.randint(64, 256)
        requests.append(([rng.randrange(3, 49152) for _ in range(prompt_len)], output_len))
    configs = {
        "lars + adaptive": SchedulerConfig(tpot_target_s=0.5, max_num_seqs=64),
        "fcfs + static:512": SchedulerConfig(chunking="static:512", max_num_seqs=64),
    }
    out = {}
    for name, scheduler in configs.items():
        if only not in name:
            continue
        llm = LLM(model, scheduler=scheduler, device=device, dtype="float32", kv_memory_gb=0.5)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
        llm.generate([p for p, _ in requests[:4]], params[:4])  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params)
        out[name] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--trees", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="only the schedulers whose name has this")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.device, args.only)
    if args.trees is None:
        ap.error("--trees BEFORE AFTER is required")
    runs: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for label, tree in zip(("before", "after"), args.trees):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            cmd = [sys.executable, __file__, "--child", "--model", args.model]
            cmd += ["--device", args.device, "--only", args.only]
            line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            for name, tps in json.loads(line.stdout.strip().splitlines()[-1]).items():
                runs.setdefault((name, label), []).append(tps)
                print(f"round {r + 1} {label} {name}: {tps:.1f} tok/s", flush=True)
    print("\n| scheduler | before | after | after / before |\n|---|---|---|---|")
    for name in dict.fromkeys(n for n, _ in runs):
        b, a = (statistics.median(runs[name, k]) for k in ("before", "after"))
        print(f"| {name} | {b:.0f} | {a:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
