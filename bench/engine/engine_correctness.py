"""Token-for-token check of the engine against transformers' `generate` on the same weights.

    python bench/engine/engine_correctness.py [--new-tokens 64] [--dtype bfloat16] [--kernels torch]

20 prompts of 5 to 2,000 tokens (slices of text in this repository), 64 greedy new tokens
each, all submitted together, under several policies and chunkings, and once with a KV cache
too small for them, which forces recompute preemptions in the middle of decoding. Also the
largest logit difference between chunked and whole prefills of a 2,000-token prompt, and
between a whole prefill and transformers'. `--dtype` runs both in that dtype (float32, the
default, is the exact reference; in bfloat16 the order of the sums changes the rounding, so a
near-tie can break the other way: a control run first, transformers recomputing every token
against its own cached `generate`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from medha.benchmark.logits import prefill_logits
from medha.engine.checkpoint import resolve_model
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig

LENGTHS = [
    5,
    9,
    17,
    30,
    50,
    80,
    120,
    180,
    250,
    330,
    420,
    520,
    640,
    780,
    930,
    1100,
    1300,
    1500,
    1750,
    2000,
]
RUNS = [
    ("fcfs", "none", 2.0),
    ("fcfs", "static:16", 2.0),
    ("fcfs", "static:64", 2.0),
    ("lars", "adaptive", 2.0),
    ("edf", "adaptive", 2.0),
    ("srpt", "static:64", 2.0),
    ("lrs", "adaptive", 2.0),
    ("fcfs", "static:64", 0.1),
]  # the last one preempts


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--only-preemption",
        action="store_true",
        help="only the run with a KV cache too small for the prompts",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "torch", "vllm"],
        help="medha's kernels (auto: vLLM's in bf16 where the vllm extra is installed)",
    )
    args = ap.parse_args()
    runs = RUNS[-1:] if args.only_preemption else RUNS
    dtype = getattr(torch, args.dtype)
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    text = "".join(
        p.read_text() for p in sorted(Path(__file__).resolve().parents[2].glob("**/*.md"))
    )
    llm = LLM("smollm2", dtype=args.dtype, kernels=args.kernels)
    print(f"medha's kernels: {llm.engine.kernels}")
    ids = llm.tokenizer.encode(text)
    prompts = [ids[i * 37 : i * 37 + n] for i, n in enumerate(LENGTHS)]
    assert all(len(p) == n for p, n in zip(prompts, LENGTHS)), "not enough text"
    t0 = time.perf_counter()
    reference = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, do_sample=False)
            reference.append(out[0][len(p) :].tolist())
    print(f"transformers reference ({args.dtype}): {time.perf_counter() - t0:.0f} s")
    if args.dtype != "float32":
        # the control: transformers against itself, recomputing the whole sequence for every
        # token instead of decoding from its cache; what the dtype's rounding alone changes
        same = 0
        with torch.inference_mode():
            for p, ref in zip(prompts, reference):
                seq = list(p)
                for _ in range(args.new_tokens):
                    seq.append(
                        int(
                            hf(torch.tensor([seq]), logits_to_keep=1).logits[0, -1].float().argmax()
                        )
                    )
                same += seq[len(p) :] == ref
        print(f"transformers recomputing every token: {same} / {len(prompts)} identical to it")
    print()
    print("| policy | chunking | KV memory | identical prompts | preemptions | wall s |")
    print("|---|---|---|---|---|---|")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    for policy, chunking, fp32_gb in runs:
        kv_gb = fp32_gb * dtype.itemsize / 4  # the same tokens in any dtype (the last run preempts)
        llm = LLM(
            "smollm2",
            scheduler=SchedulerConfig(policy=policy, chunking=chunking, tpot_target_s=0.2),
            kv_memory_gb=kv_gb,
            dtype=args.dtype,
            kernels=args.kernels,
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        same = sum(o.token_ids == r for o, r in zip(outs, reference))
        print(
            f"| {policy} | {chunking} | {kv_gb} GiB | {same} / {len(prompts)} | "
            f"{llm.engine.scheduler.stats.preemptions} | {time.perf_counter() - t0:.0f} |"
        )
        assert llm.engine.scheduler.blocks.num_used == 0
    whole = prefill_logits("none", prompts[-1], args.dtype, kernels=args.kernels)
    print()
    for chunking in ("static:16", "static:64", "adaptive"):
        d = (prefill_logits(chunking, prompts[-1], args.dtype, kernels=args.kernels) - whole).abs()
        print(
            f"2000-token prefill, {chunking} vs whole: max |logit difference| "
            f"{d.max().item():.2e}, max relative {(d / whole.abs().clamp(min=1)).max():.2e}"
        )
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[-1]])).logits[0].float()
    print(
        f"whole prefill vs transformers: max |logit difference| "
        f"{(whole - ref).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()
