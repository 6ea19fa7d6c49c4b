"""medha's scheduler on vLLM's engine against plain vLLM, token for token.

    python bench/vllm/vllm_correctness.py [--new-tokens 32] [--dtype float32]

SmolLM2-135M, 20 prompts of 5 to 2,000 tokens (slices of this repository's text, as in
bench/engine/engine_correctness.py), all submitted together, greedy. Plain vLLM (its own scheduler)
is the reference; then medha's scheduler drives the same engine (`--scheduler-cls
medha.vllm_executor.MedhaScheduler`) under fcfs/none, lars/adaptive and edf/adaptive, and once
with a KV cache of 24 blocks (3,072 tokens), so small that medha preempts. For each: identical
prompts, medha's batches, chunks vLLM ran differently from medha's plan, and vLLM's KV usage
after the run (0: nothing left behind). A control run first: plain vLLM cutting the same
prompts into 256-token steps, against plain vLLM, for how many prompts batching alone changes
in --dtype. Each engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LENGTHS = [5, 9, 17, 30, 50, 80, 120, 180, 250, 330, 420, 520, 640, 780, 930]
LENGTHS += [1100, 1300, 1500, 1750, 2000]
RUNS = [
    ("fcfs", "none", None),
    ("lars", "adaptive", None),
    ("edf", "adaptive", None),
    ("fcfs", "static:256", 24),  # 24 blocks of 128 tokens, 3,072 tokens: preemptions
]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget-s", type=float, default=0.2, help="lars/edf iteration budget")
    ap.add_argument(
        "--only-preemption", action="store_true", help="only the run with the small KV cache"
    )
    args = ap.parse_args()
    import vllm

    from medha.engine.checkpoint import resolve_model
    from medha.engine.tokenizer import Tokenizer

    path = str(resolve_model("smollm2"))
    text = "".join(
        p.read_text() for p in sorted(Path(__file__).resolve().parents[2].glob("**/*.md"))
    )
    ids = Tokenizer(path).encode(text)
    prompts = [ids[i * 37 : i * 37 + n] for i, n in enumerate(LENGTHS)]
    assert all(len(p) == n for p, n in zip(prompts, LENGTHS)), "not enough text"
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run(medha: dict | None, num_blocks: int | None, step_tokens: int | None = None):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        max_len = 2048 if num_blocks else 4096  # vLLM wants one whole max-length request to fit
        kwargs = dict(model=path, dtype=args.dtype, max_model_len=max_len, seed=0)
        kwargs.update(max_num_batched_tokens=step_tokens or max_len, enforce_eager=True)
        kwargs.update(num_gpu_blocks_override=num_blocks)
        if medha is not None:
            kwargs.update(
                scheduler_cls="medha.vllm_executor.MedhaScheduler",
                additional_config={"medha": medha},
            )
        llm = vllm.LLM(**kwargs)
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        return [list(o.outputs[0].token_ids) for o in outs], sched, wall

    reference, _, wall = run(None, None)
    print(f"plain vLLM {vllm.__version__} ({args.dtype}): {wall:.1f} s")
    # the control: vLLM against itself, its own scheduler cutting the same prompts into
    # 256-token steps. Where the dtype's arithmetic depends on how a batch is shaped (bf16 on
    # a CPU), this is how many prompts batching alone changes, with no medha involved
    control, _, _ = run(None, None, 256)
    same = sum(o == r for o, r in zip(control, reference))
    print(f"plain vLLM, 256 tokens per step: {same} / {len(prompts)} identical to it\n")
    print(
        "| policy | chunking | KV cache | identical prompts | medha batches | preemptions | "
        "plan revisions | KV usage after | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, chunking, num_blocks in RUNS[-1:] if args.only_preemption else RUNS:
        medha = {"policy": policy, "chunking": chunking}
        if chunking == "adaptive":
            medha["iteration_budget_s"] = args.budget_s
        outs, sched, wall = run(medha, num_blocks)
        same = sum(o == r for o, r in zip(outs, reference))
        print(
            f"| {policy} | {chunking} | {f'{num_blocks} blocks' if num_blocks else '1 GiB'} | "
            f"{same} / {len(prompts)} | "
            f"{sched.medha.stats.batches} | {sched.medha.stats.preemptions} | "
            f"{sched.plan_revisions} | {sched.kv_cache_manager.usage:.3f} | {wall:.1f} |"
        )


if __name__ == "__main__":
    main()
