"""The simulator against the engine, decision by decision, for a stream-pipeline run and a
KV-cache parallel run on this machine.

    python bench/sim/sim_engine_schedule.py [--predictor profiled:PATH] [--prompt-lens 1800,40,...]

The same requests (one long prompt, then short ones, all arriving at once, 6 output tokens
each, fcfs with adaptive chunks) go through the real engine (SmolLM2-135M, spp 2; then kvp 2
with --kvp-group tokens per group) and through the simulator fed the engine's predictor (by
default this machine's single-process profile). It prints how many of the batches agree (the
prefill chunks, the decodes, how many batches had completed when each was formed, the KVP
groups holding each chunk's request), the first difference if any, whether the pipeline
overlap of consecutive chunks agrees, and the long prompt's KVP group growth.
"""

from __future__ import annotations

import argparse

from medha.analysis.schedule_match import engine_run, first_difference, overlaps, sim_run
from medha.engine.checkpoint import resolve_model
from medha.engine.config import EngineConfig
from medha.engine.setup import profile_path
from medha.engine.tokenizer import Tokenizer
from medha.scheduler.config import SchedulerConfig

TEXT = " ".join(f"line {i} of the harbour log." for i in range(1000))


def compare(name: str, prompts, lens, args, **parallel) -> None:
    # deadlines out of both clocks' reach: one passed lets the packer run longer steps
    # (overload), a decision the engine's clock would make and the simulator's not
    sched = SchedulerConfig(policy="fcfs", chunking="adaptive", ttft_deadline_s=3600.0)
    engine_log, ids, predictor, engine_stages, _ = engine_run(
        prompts, args.max_tokens, sched, kv_memory_gb=0.2, predictor=args.predictor, **parallel
    )
    sim_log, sim_stages = sim_run(ids, lens, args.max_tokens, sched, predictor)
    same = sum(a == b for a, b in zip(engine_log, sim_log))
    diff = first_difference(engine_log, sim_log)
    print(f"\n{name}: {predictor.describe()}")
    print(
        f"  batches: engine {len(engine_log)}, simulator {len(sim_log)}; equal decisions "
        f"{same}/{max(len(engine_log), len(sim_log))}; first difference: "
        f"{'none' if diff is None else diff}"
    )
    if diff is not None:
        print(f"    engine    {engine_log[diff] if diff < len(engine_log) else '-'}")
        print(f"    simulator {sim_log[diff] if diff < len(sim_log) else '-'}")
    if engine_stages:
        e, s = overlaps(engine_stages), overlaps(sim_stages)
        print(
            f"  stage 0 started batch i+1 before stage 1 finished batch i: engine "
            f"{sum(e)}/{len(e)}, simulator {sum(s)}/{len(s)}, agreeing on "
            f"{sum(a == b for a, b in zip(e, s))}/{len(e)}"
        )
    growth = [
        (c[1] + c[2], g) for p, _, _, gs, _ in engine_log for c, g in zip(p, gs) if c[0] == ids[0]
    ]
    if parallel.get("kvp", 1) > 1:
        steps = [
            f"{end} tokens -> {g}"
            for i, (end, g) in enumerate(growth)
            if i == 0 or g != growth[i - 1][1]
        ]
        print(f"  long prompt's KVP groups (engine): {', '.join(steps)}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = profile_path(EngineConfig())  # the engine's own, at its default dtype
    ap.add_argument(
        "--predictor",
        default=f"profiled:{default}",
        help="the engine's batch-time model, which the simulator is fed too",
    )
    ap.add_argument("--prompt-lens", default="1800,40,25,60,12,200,33")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument(
        "--kvp-group", type=int, default=512, help="max_tokens_per_kvp_group of the kvp run"
    )
    args = ap.parse_args()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    words = Tokenizer(resolve_model("smollm2")).encode(TEXT)
    prompts = [words[i : i + n] for i, n in enumerate(lens)]
    compare("spp 2", prompts, lens, args, spp=2)
    compare("kvp 2", prompts, lens, args, kvp=2, max_tokens_per_kvp_group=args.kvp_group)


if __name__ == "__main__":
    main()
