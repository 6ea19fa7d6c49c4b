"""Engine throughput on CPU against transformers, side by side in one run.

    python bench/engine/engine_throughput.py [--num-requests 64] [--skip-hf] [--skip-cb]

64 requests, prompts of 64-512 random tokens and 64-256 output tokens (uniform, seed 0, EOS
ignored, greedy), SmolLM2-135M in fp32: useful output tokens per second of medha's engine
(all requests submitted at once) against transformers' static `generate` in batches of 8 and
its continuous batching (medha/benchmark/hf_baselines.py). Then prefill GFLOP/s of one chunk as a
fraction of this machine's measured fp32 GEMM peak.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from medha.benchmark.harness import add_common_args
from medha.benchmark.hf_baselines import (
    hf_continuous_batching,
    hf_prefill_gflops,
    hf_static_generate,
    make_workload,
)
from medha.engine.llm import LLM
from medha.engine.profiler import Profiler
from medha.engine.sampling_params import SamplingParams
from medha.perf.grid import Shape
from medha.perf.hardware_specs import this_cpu
from medha.scheduler.config import SchedulerConfig

CONFIGS = {  # name -> scheduler; a throughput run wants iterations long enough for big batches
    "medha lars + adaptive (TPOT target 0.5 s)": SchedulerConfig(
        tpot_target_s=0.5, max_num_seqs=64
    ),
    "medha fcfs + static:512": SchedulerConfig(chunking="static:512", max_num_seqs=64),
}


def medha_throughput(llm: LLM, requests) -> dict:
    params = [SamplingParams(max_tokens=out, temperature=0, ignore_eos=True) for _, out in requests]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    wall = time.perf_counter() - t0
    useful = sum(len(o.token_ids) for o in outs)
    assert useful == sum(out for _, out in requests)
    return {"tokens_per_s": useful / wall, "wall_s": wall, "useful_tokens": useful}


def prefill_flops(a, n: int, lm_head_rows: int) -> float:
    """Matmul FLOPs of the decoder layers for n tokens, causal attention, and the LM head on
    `lm_head_rows` positions."""
    h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
    layer = h * (a.num_heads + 2 * a.num_kv_heads) * d + a.num_heads * d * h + 3 * h * i
    attention = 4 * a.num_layers * a.num_heads * d * n * (n + 1) / 2
    return 2 * n * a.num_layers * layer + attention + 2 * lm_head_rows * h * a.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap, num_requests=64)
    ap.add_argument("--skip-hf", action="store_true", help="only medha")
    ap.add_argument(
        "--skip-cb",
        action="store_true",
        help="skip transformers' continuous batching (the slowest run)",
    )
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    requests = make_workload(args.num_requests)
    print(
        f"{len(requests)} requests: {sum(len(p) for p, _ in requests)} prompt tokens, "
        f"{sum(o for _, o in requests)} output tokens; {torch.get_num_threads()} threads\n"
    )
    rows = []
    warm = make_workload(2, prompt_range=(32, 32), output_range=(4, 4))
    llm = None
    for name, cfg in CONFIGS.items():
        llm = LLM("smollm2", scheduler=cfg, kv_memory_gb=2.0)
        medha_throughput(llm, warm)
        rows.append((name, medha_throughput(llm, requests)))
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
        runs = [("transformers generate, batches of 8", hf_static_generate)]
        if not args.skip_cb:
            runs.append(("transformers continuous batching", hf_continuous_batching))
        for name, fn in runs:
            fn(hf, warm)
            rows.append((name, fn(hf, requests)))
    print("| system | useful tokens / s | wall s |")
    print("|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['wall_s']:.0f} |")
    static = dict(rows).get("transformers generate, batches of 8")
    if static:
        best = max(r["tokens_per_s"] for n, r in rows if n.startswith("medha"))
        print(
            f"\nmedha / transformers static generate: {best / static['tokens_per_s']:.1f}x "
            "(goal >= 3x)"
        )

    peak = this_cpu().peak_flops
    profiler = Profiler(llm.engine)
    a = llm.engine.runner.args
    print(
        f"\nprefill of one chunk at KV offset 0; fp32 GEMM peak of this CPU "
        f"{peak / 1e9:.0f} GFLOP/s (medha hardware)\n"
    )
    print("| tokens | medha GFLOP/s | share of peak | transformers GFLOP/s | share of peak |")
    print("|---|---|---|---|---|")
    for n in (256, 512, 1024, 2048):
        t = profiler.measure(Shape(((n, 0),), ()), repeats=3)
        ours = prefill_flops(a, n, 1) / t
        theirs = hf_prefill_gflops(hf, n) * 1e9 if not args.skip_hf else None
        hf_cell = "-" if theirs is None else f"{theirs / 1e9:.0f} | {theirs / peak:.0%}"
        print(f"| {n} | {ours / 1e9:.0f} | {ours / peak:.0%} | {hf_cell} |")


if __name__ == "__main__":
    main()
