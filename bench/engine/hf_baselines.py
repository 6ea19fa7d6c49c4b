"""Hugging Face transformers baselines for medha's engine, on CPU.

    python bench/engine/hf_baselines.py [--model PATH] [--num-requests 64] [--skip-cb]

Runs one synthetic offline workload (random prompt ids, fixed per-request output lengths, EOS
ignored, greedy) through transformers' static batching (`generate`, batches of 8) and its
continuous batching (`ContinuousBatchingManager`), and measures the prefill GFLOP/s of a single
forward pass. Numbers are meant as the bar medha's engine has to clear on the same machine.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM

from medha.benchmark.harness import add_common_args
from medha.benchmark.hf_baselines import (
    hf_continuous_batching,
    hf_prefill_gflops,
    hf_static_generate,
    make_workload,
)

MODEL_PATH = None  # default: the embedded SmolLM2 checkpoint medha converts


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=MODEL_PATH)
    add_common_args(ap, num_requests=64)
    ap.add_argument("--skip-cb", action="store_true", help="skip continuous batching")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    if args.model is None:
        from medha.engine.checkpoint import resolve_model

        args.model = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    requests = make_workload(args.num_requests, vocab_size=model.config.vocab_size)
    print(
        f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
        f"{sum(o for _, o in requests)} output tokens, {torch.get_num_threads()} threads, "
        f"attention {model.config._attn_implementation}"
    )
    runs = [("static generate (batch 8)", hf_static_generate)]
    if not args.skip_cb:
        runs.append(("continuous batching", hf_continuous_batching))
    warmup = make_workload(2, prompt_range=(32, 32), output_range=(4, 4))
    for name, fn in runs:
        fn(model, warmup)  # first-call costs (oneDNN primitives, allocator) stay out of the timing
        r = fn(model, requests)
        extra = f", setup {r['setup_s']:.1f} s" if "setup_s" in r else ""
        print(
            f"{name:<26} {r['tokens_per_s']:7.1f} tok/s  ({r['useful_tokens']} useful / "
            f"{r['generated_tokens']} generated tokens in {r['wall_s']:.1f} s{extra})"
        )
    for n in (256, 512, 1024):
        print(f"prefill {n:>4} tokens           {hf_prefill_gflops(model, n):7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
