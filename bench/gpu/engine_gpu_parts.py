"""The parts of medha's engine on a CUDA GPU: the decode attention kernels, the prefix merge's
kernels, and a decode step broken down (issue 49; docs/engine.md "CUDA").

    python bench/gpu/engine_gpu_parts.py --out DIR --tok TOK --kernels [--steps --ckpt CKPT]

--kernels: the Triton decode kernel against exact attention and against the torch path's
gathers (error, time, KV bandwidth) for a mix of contexts, 64 x 640, one over 1K to 131K, in
fp32 and bf16; a 2,048-token chunk over prefixes of 2K/30K/121K tokens by the masked SDPA, the
flash merge, cuDNN's merge, torch's lower-right causal bias, against its share of the whole
prompt's causal attention; and a small random Llama (4 layers, 8 heads of 128, 2 KV heads,
built here, TOK holding SmolLM2's tokenizer files and config.json) decoding greedily by the
torch path, the Triton kernel eagerly and from CUDA graphs, fp32 and bf16: tokens compared.
--steps: on CKPT (gpu_check.py's Llama-3-8B-shaped checkpoint, /tmp/llama8b-shape), one decode
and 64 decodes a step, with graphs and async scheduling (the default), with graphs one batch at
a time, and eagerly: the step's wall time and its parts (schedule, prepare, run, update), a
Python profile of the 64-wide step, the eager lone step's kernels.
--small: only build the small Llama. --cpu: a dry run of all of it on this CPU (with
TRITON_INTERPRET=1), tiny sizes, nothing timed that matters.
Writes DIR/diag_kernels.json and DIR/diag_steps.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

# the checkout this script is in (the folder holding medha/benchmark/)
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "medha" / "benchmark").is_dir())


def this_checkout(name: str):
    """medha/benchmark/<name>.py of this script's checkout, loaded by its path: medha itself is
    imported only once --project is on the path (the checkout measured), and the checks are
    this script's whatever that checkout holds."""
    spec = importlib.util.spec_from_file_location(
        f"_engine_gpu_parts_{name}", ROOT / "medha" / "benchmark" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


harness = this_checkout("harness")
parts = this_checkout("gpu_parts")
R = parts.R
OUT = "."


def save(name):
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(R, f, indent=1)


def main():
    global OUT
    ap = argparse.ArgumentParser()
    harness.add_common_args(
        ap, out=..., out_help="the folder diag_kernels.json and diag_steps.json go to"
    )
    ap.add_argument("--project", default=".", help="the medha checkout to import")
    ap.add_argument("--tok", default=".gpu/tok")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--steps", action="store_true")
    ap.add_argument("--small", action="store_true", help="only build the small random Llama")
    ap.add_argument("--ckpt", default="/tmp/llama8b-shape")
    ap.add_argument(
        "--cpu", action="store_true", help="dry run of the kernel checks (TRITON_INTERPRET=1)"
    )
    a = ap.parse_args()
    OUT = a.out
    if a.cpu:
        parts.DEV = "cpu"
    sys.path.insert(0, os.path.abspath(a.project))
    R["device"] = torch.cuda.get_device_name() if parts.DEV == "cuda" else "cpu"
    t0 = time.time()
    if a.kernels:
        parts.guard("decode_kernel", parts.decode_kernel_checks)
        save("diag_kernels.json")
        parts.guard("prefix", parts.prefix_checks)
        save("diag_kernels.json")
        parts.guard("engine_small", lambda: parts.engine_checks(os.path.abspath(a.tok)))
        save("diag_kernels.json")
    if a.small:
        print("small model at", parts.small_model(os.path.abspath(a.tok)), flush=True)
    if a.steps:
        ckpt = a.ckpt if parts.DEV == "cuda" else R.get("small_model", "/tmp/small-llama")
        parts.guard("steps", lambda: parts.step_breakdown(ckpt))
        save("diag_steps.json")
    print(f"diag done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
