"""Stream-pipeline overlap on this machine: one long prefill at spp 1 and spp 2.

    python bench/engine/engine_spp.py [--tokens 2048] [--chunk 256]

One prompt of --tokens tokens (fixed English text), prefilled in static chunks of --chunk
tokens, 1 output token, SmolLM2-135M fp32 on CPU. spp 1 runs once with every core's threads
and once with one thread (what each spp-2 stage process gets), spp 2 with one process per
stage. For spp 2 it prints every chunk's (start, end) on each stage, relative to the first
start, how many consecutive chunks overlapped (stage 0 started chunk i+1 before stage 1 had
finished chunk i: the wall-clock side of what tests/test_parallel_schedule.py checks as decisions,
which depends on how the machine's cores are shared), and the pipeline's idle share:
1 - (busy time of all stages) / (stages x span).
"""

from __future__ import annotations

import argparse
import time

from medha.analysis.schedule_match import overlaps
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig

TEXT = " ".join(
    f"Report {i}: the harbour of town {i * 7 % 13} saw {i * 3 % 11} ships arrive "
    "before noon, and the market sold fish, bread and oil."
    for i in range(400)
)


def prefill_s(llm: LLM, ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([ids[:64]], params)  # warm-up
    t0 = time.perf_counter()
    llm.generate([ids], params)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    sched = SchedulerConfig(policy="fcfs", chunking=f"static:{args.chunk}")
    rows = []
    for label, options in (
        ("spp 1, all threads", {}),
        ("spp 1, 1 thread", {"threads": 1}),
        ("spp 2 (1 thread per stage)", {"spp": 2}),
    ):
        llm = LLM("smollm2", kv_memory_gb=0.2, scheduler=sched, **options)
        ids = llm.tokenizer.encode(TEXT)[: args.tokens]
        rows.append((label, prefill_s(llm, ids)))
        if options.get("spp"):
            warm = min(t[0] for t in llm.engine.pipeline.stage_times)  # the warm-up's batch
            times = [t for t in llm.engine.pipeline.stage_times if t[0] != warm]
            t_first = min(t[2] for t in times)
            span = max(t[3] for t in times) - t_first
            busy = sum(t[3] - t[2] for t in times)
            print("chunk | stage | start (ms) | end (ms)")
            for b, s, a, e in sorted(times):
                print(f"{b} | {s} | {(a - t_first) * 1e3:.0f} | {(e - t_first) * 1e3:.0f}")
            idle = 1 - busy / (2 * span)
            pairs = overlaps(times)
            overlapped = f"{sum(pairs)} of {len(pairs)}"
            llm.engine.close()
    print(f"\n{args.tokens}-token prefill in chunks of {args.chunk}\n")
    print("| run | prefill time |")
    print("|---|---|")
    for label, t in rows:
        print(f"| {label} | {t:.2f} s |")
    print(f"\nspp 2: consecutive chunks overlapping on the two stages: {overlapped}")
    print(f"spp 2 pipeline idle share: {idle:.0%}")


if __name__ == "__main__":
    main()
