"""What a step of medha's engine costs: where a chunked prefill's time goes.

    python bench/engine/engine_step_cost.py [--prompt-len 6000] [--budgets default,0.5,1,whole]
                                            [--rounds 2] [--model smollm2] [--device auto]
                                     [--dtype auto] [--kernels auto]

One prompt alone on medha's engine (offline `LLM`, one output token), prefilled whole (chunking
`none`) and in chunks that fit each budget (`default`: the engine's resolved iteration budget;
a number: that budget, every step bounded by it). For each: wall time, steps, and, from one
more run under torch's profiler, the time of each kind of operator summed over the run:

- GEMMs (linear layers, LM head): what every step pays for the weights, and the tokens' work;
- attention (the chunk's queries over its whole KV prefix, re-read by every chunk);
- other operators (norms, rotary, KV writes, embeddings, sampling);
- host: the wall time no operator accounts for (scheduling, building the step's inputs,
  Python, waiting for the worker threads to wake; on a GPU, the time it is idle).

Each chunked run's extra time over the whole prompt is split the same way and divided by its
extra steps: the per-step fixed cost of each kind. The predictor's view of the same chunks (its
chunking price) is printed beside the measurement. Alternates the configurations for --rounds
rounds (this CPU's speed drifts) and reports the median wall time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

# operator names (CPU) and kernel names (CUDA) by kind, lower case
GEMM_OPS = ("mm", "addmm", "matmul", "linear", "bmm_gemm")
GEMM_WORDS = ("gemm", "nvjet", "cutlass", "cublas", "onednn", "mkldnn", "_weight_int8pack_mm")
ATTENTION_WORDS = ("scaled_dot_product", "flash", "fmha", "attention", "softmax")


def kind_of(op: str) -> str:
    name = op.lower().removeprefix("aten::")
    if any(k in name for k in ATTENTION_WORDS):
        return "attention"
    if name in GEMM_OPS or any(k in name for k in GEMM_WORDS):
        return "gemm"
    return "other"


def make_llm(budget: str, args):
    from medha.engine.llm import LLM
    from medha.scheduler.config import SchedulerConfig

    common = dict(policy="fcfs", prefix_cache="off")  # (the prompt reruns: no cache hits)
    if budget == "whole":
        sched = SchedulerConfig(chunking="none", **common)
    elif budget == "default":
        sched = SchedulerConfig(chunking="adaptive", **common)
    else:
        b = float(budget)
        sched = SchedulerConfig(
            chunking="adaptive", iteration_budget_s=b, arrival_wait_s=b, **common
        )
    return LLM(
        model=args.model,
        scheduler=sched,
        dtype=args.dtype,
        kernels=args.kernels,
        device=args.device,
    )


def run_once(llm, prompt: list[int]) -> tuple[float, int]:
    from medha.engine.sampling_params import SamplingParams

    stats = llm.engine.scheduler.stats
    before = stats.batches
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - t0, stats.batches - before


def profiled(llm, prompt: list[int]) -> dict[str, float]:
    """Seconds of each kind of operator (self time, summed) and the run's wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.engine.setup.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall, _ = run_once(llm, prompt)
        if cuda:
            torch.cuda.synchronize()
    kinds = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        if event.key.startswith(("ProfilerStep", "[memory]")):
            continue
        if cuda:  # the kernels' own device time (an operator's counts its kernels again)
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            spent = event.self_device_time_total
        else:  # the operators' own time
            spent = event.self_cpu_time_total
        kinds[kind_of(event.key)] += spent / 1e6
    kinds["host"] = max(0.0, wall - sum(kinds.values()))
    kinds["wall"] = wall
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=6000)
    ap.add_argument("--budgets", default="default,0.5,1,whole", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="smollm2", help="checkpoint directory, or smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernels", default="auto")
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    budgets = args.budgets.split(",")
    llms = {}
    for b in budgets:  # one engine each, warmed up on the prompt once
        llms[b] = make_llm(b, args)
        run_once(llms[b], prompt)
    walls: dict[str, list[float]] = {b: [] for b in budgets}
    steps: dict[str, int] = {}
    for i in range(args.rounds):
        for b in budgets if i % 2 == 0 else reversed(budgets):
            wall, n = run_once(llms[b], prompt)
            walls[b].append(wall)
            steps[b] = n
            print(f"round {i} {b}: {wall:.3f} s, {n} steps", flush=True)
    parts = {b: profiled(llms[b], prompt) for b in budgets}
    engine = next(iter(llms.values())).engine
    from medha.perf.chunking_price import chunking_price

    setup = engine.setup
    print(f"\n{args.prompt_len}-token prompt alone, {setup.dtype}, {setup.kernels} kernels")
    print(f"predictor: {engine.predictor.describe()}\n")
    print(
        "| budget | steps | wall (median) | / whole | predicted / whole | GEMMs | attention | "
        "other ops | host |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    whole = statistics.median(walls["whole"]) if "whole" in walls else None
    resolved = {b: llms[b].engine.scheduler.config.iteration_budget_s for b in budgets}
    for b in budgets:
        w = statistics.median(walls[b])
        p = parts[b]
        ratio = f"{w / whole:.2f}x" if whole else ""
        predicted = (
            ""
            if b == "whole"
            else f"{chunking_price(engine.predictor, resolved[b], args.prompt_len):.2f}x"
        )
        name = "whole" if b == "whole" else f"{resolved[b]:.3g} s"
        name += " (default)" if b == "default" else ""
        print(
            f"| {name} | {steps[b]} | {w:.3f} s | {ratio} | {predicted} | {p['gemm']:.3f} s | "
            f"{p['attention']:.3f} s | {p['other']:.3f} s | {p['host']:.3f} s |"
        )
    if "whole" in parts:
        print("\nPer extra step over the whole prompt (profiled run; ms):\n")
        print("| budget | extra steps | GEMMs | attention | other ops | host | total |")
        print("|---|---|---|---|---|---|---|")
        for b in budgets:
            extra = steps[b] - steps["whole"]
            if b == "whole" or extra <= 0:
                continue
            d = {k: (parts[b][k] - parts["whole"][k]) / extra * 1e3 for k in parts[b]}
            print(
                f"| {resolved[b]:.3g} s | {extra} | {d['gemm']:.1f} | {d['attention']:.1f} | "
                f"{d['other']:.1f} | {d['host']:.1f} | {d['wall']:.1f} |"
            )
    for llm in llms.values():
        llm.engine.close()


if __name__ == "__main__":
    main()
