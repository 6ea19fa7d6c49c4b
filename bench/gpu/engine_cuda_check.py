"""The engine on a CUDA GPU against transformers on the same weights, token for token.

    python bench/gpu/engine_cuda_check.py --model DIR [--new-tokens 24]

DIR: a Llama-family checkpoint (safetensors). Prompts of 5 to 400 tokens (slices of this
file's text), greedy, all submitted together, under fcfs with chunks of 16 tokens and under
lars with adaptive chunks, in float32 and bfloat16; transformers runs each prompt alone with
`generate` in the same dtype on the same GPU. Prints, per run, how many prompts match
token for token and where the first difference of the others lies. A tp/spp/kvp layout on
CUDA is refused (gloo on CPU only); this checks the single-process CUDA path.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from medha.benchmark.harness import add_common_args
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig

LENGTHS = [5, 9, 17, 40, 80, 150, 260, 400]
RUNS = [("fcfs", "static:16"), ("lars", "adaptive")]


def reference(model: str, prompts: list[list[int]], new_tokens: int, dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=dtype).cuda().eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            y = hf.generate(
                x,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    del hf
    torch.cuda.empty_cache()
    return outs


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y),
        None if len(a) == len(b) else min(len(a), len(b)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-tokens", type=int, default=24)
    add_common_args(ap, out=None, out_help="also write the results as JSON here")
    args = ap.parse_args()
    results = []
    text = Path(__file__).read_text() * 4
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        probe = LLM(args.model, device="cuda", dtype=dtype_name, kv_memory_gb=0.5)
        words = probe.tokenizer.encode(text)
        prompts = [words[i * 13 : i * 13 + n] for i, n in enumerate(LENGTHS)]
        del probe
        expected = reference(args.model, prompts, args.new_tokens, dtype)
        for policy, chunking in RUNS:
            llm = LLM(
                args.model,
                device="cuda",
                dtype=dtype_name,
                kv_memory_gb=0.5,
                scheduler=SchedulerConfig(policy=policy, chunking=chunking),
            )
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
            got = [o.token_ids for o in llm.generate(prompts, params)]
            diffs = [first_difference(g, e) for g, e in zip(got, expected)]
            row = {
                "dtype": dtype_name,
                "policy": policy,
                "chunking": chunking,
                "equal": sum(d is None for d in diffs),
                "prompts": len(prompts),
                "first_differences": {n: d for n, d in zip(LENGTHS, diffs) if d is not None},
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
