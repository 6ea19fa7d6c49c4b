"""Greedy tokens of medha's engine (float32, torch's ops) dumped for a before/after comparison.

    PYTHONPATH=BEFORE python bench/engine/engine_tokens.py --text T --out before.json
    PYTHONPATH=AFTER  python bench/engine/engine_tokens.py --text T --out after.json
    python bench/engine/engine_tokens.py --compare before.json after.json

The 20 prompt lengths of bench/engine/engine_correctness.py (5 to 2,000 tokens, sliced from the file
--text, which both trees must read the same), 64 new tokens each, all submitted together, under
fcfs/none, fcfs/static:64, lars/adaptive and edf/adaptive with 2 GiB of KV, fcfs/static:64 with
0.1 GiB, and lars/adaptive with 0.1 GiB and swap preemption. Self-contained, so that it runs
against any tree's `medha` (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import runpy
import time
from pathlib import Path

LENGTHS = [5, 9, 17, 30, 50, 80, 120, 180, 250, 330, 420, 520, 640, 780, 930]
LENGTHS += [1100, 1300, 1500, 1750, 2000]
RUNS = [  # policy, chunking, KV GiB, preemption mode
    ("fcfs", "none", 2.0, "recompute"),
    ("fcfs", "static:64", 2.0, "recompute"),
    ("lars", "adaptive", 2.0, "recompute"),
    ("edf", "adaptive", 2.0, "recompute"),
    ("fcfs", "static:64", 0.1, "recompute"),
    ("lars", "adaptive", 0.1, "swap"),
]


def dump(text: str, out: str) -> None:
    from medha.engine.llm import LLM
    from medha.engine.sampling_params import SamplingParams
    from medha.scheduler.config import SchedulerConfig

    engine = {"dtype": "float32", "kernels": "torch"}
    ids = LLM("smollm2", kv_memory_gb=0.01, **engine).tokenizer.encode(text)
    prompts = [ids[i * 37 : i * 37 + n] for i, n in enumerate(LENGTHS)]
    assert all(len(p) == n for p, n in zip(prompts, LENGTHS)), "not enough text"
    params = SamplingParams(max_tokens=64, temperature=0)
    tokens = {}
    for policy, chunking, gb, mode in RUNS:
        t0 = time.perf_counter()
        scheduler = SchedulerConfig(
            policy=policy, chunking=chunking, tpot_target_s=0.2, preemption_mode=mode
        )
        llm = LLM("smollm2", scheduler=scheduler, kv_memory_gb=gb, **engine)
        name = f"{policy}-{chunking}-{gb}-{mode}"
        tokens[name] = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.scheduler.stats
        print(f"{name}: {stats.preemptions} preemptions, {time.perf_counter() - t0:.0f} s")
    Path(out).write_text(json.dumps(tokens))


def compare(a: str, b: str) -> int:
    before, after = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    bad = 0
    for name, outs in before.items():
        same = sum(x == y for x, y in zip(outs, after.get(name, [])))
        bad += same != len(outs)
        print(f"{name}: {same} / {len(outs)} prompts token-identical")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--text", help="the text the prompts are sliced from")
    # this checkout's harness, by its path: the medha imported may be an older tree's
    harness = runpy.run_path(
        str(Path(__file__).resolve().parents[2] / "medha/benchmark/harness.py")
    )
    harness["add_common_args"](ap, out=None, out_help="where to write the tokens (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        raise SystemExit(compare(*args.compare))
    if not (args.text and args.out):
        ap.error("--text and --out, or --compare")
    dump(Path(args.text).read_text(), args.out)


if __name__ == "__main__":
    main()
