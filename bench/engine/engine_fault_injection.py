"""Fault injection into a real engine: each run makes one random request fail at one random
place of its step, and checks that it ends alone.

    python bench/engine/engine_fault_injection.py [--runs 100] [--seed 0]

Each run sends the 8 prompts of tests/test_isolation.py (medha/benchmark/faults.py: 3-90
tokens, 6 greedy tokens each) through `LLM.generate` on the tiny random Llama with chunks of 16
tokens, so prompts prefill over several batches beside the others' decodes. One of them, the
victim, fails from the k-th time (k in 0-6) its work passes one place: the runner reading its
inputs, the forward pass with its rows in it (found by re-running the batch in halves), the
sampler (NaN in its logits row), or the detokenizer. The table counts the runs whose victim
failed, the other requests that did not finish with their quiet-run tokens, KV blocks left in
use, and errors out of the engine.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import pytest

from medha.benchmark.faults import GREEDY, PLACES, PROMPTS, inject
from medha.benchmark.harness import add_common_args
from medha.benchmark.tiny_llama import build_tiny_llama
from medha.engine.llm import LLM
from medha.scheduler.config import SchedulerConfig

logging.getLogger("medha.engine").setLevel(logging.ERROR)  # the failures are the point


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=100)
    add_common_args(ap, seed=0)
    args = ap.parse_args()
    model = build_tiny_llama(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    llm = LLM(model, SchedulerConfig(policy="fcfs", chunking="static:16"), kv_memory_gb=0.01)
    quiet = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    rng = random.Random(args.seed)
    stats = {
        p: {"runs": 0, "victim failed": 0, "others lost": 0, "blocks leaked": 0, "engine errors": 0}
        for p in PLACES
    }
    t0 = time.perf_counter()
    for _ in range(args.runs):
        where, victim, after = rng.choice(PLACES), rng.randrange(len(PROMPTS)), rng.randint(0, 6)
        row = stats[where]
        row["runs"] += 1
        first = int(llm.generate([PROMPTS[0]], GREEDY)[0].request_id.split("-")[1]) + 1
        victim_id = f"gen-{first + victim}"
        with pytest.MonkeyPatch.context() as mp:
            inject(mp, llm, where, victim_id, PROMPTS[victim], after)
            try:
                outs = llm.generate(PROMPTS, GREEDY)
            except Exception as e:  # noqa: BLE001 - counted
                print(f"engine error: {type(e).__name__}: {e}", file=sys.stderr)
                row["engine errors"] += 1
                continue
        for i, out in enumerate(outs):
            if out.request_id == victim_id and out.finish_reason == "error":
                row["victim failed"] += 1
            elif out.finish_reason != "length" or out.token_ids != quiet[i]:
                row["others lost"] += 1
        row["blocks leaked"] += llm.engine.scheduler.blocks.num_used
        llm.engine.scheduler.check_invariants()
    print(f"{args.runs} runs in {time.perf_counter() - t0:.1f} s (seed {args.seed})")
    print(
        f"{'place':12s} {'runs':>5s} {'victim failed':>14s} {'others lost':>12s} "
        f"{'blocks leaked':>14s} {'engine errors':>14s}"
    )
    for where, r in stats.items():
        print(
            f"{where:12s} {r['runs']:5d} {r['victim failed']:14d} {r['others lost']:12d} "
            f"{r['blocks leaked']:14d} {r['engine errors']:14d}"
        )
    total = {k: sum(r[k] for r in stats.values()) for k in next(iter(stats.values()))}
    print(
        f"{'all':12s} {total['runs']:5d} {total['victim failed']:14d} "
        f"{total['others lost']:12d} {total['blocks leaked']:14d} {total['engine errors']:14d}"
    )


if __name__ == "__main__":
    main()
