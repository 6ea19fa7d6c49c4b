"""Swap vs recompute preemption under KV memory pressure, and priority classes under load.

    python bench/sim/sim_swap_vs_recompute.py              # the simulated tables (~4 min)
    python bench/sim/sim_swap_vs_recompute.py --engine     # plus SmolLM2 on this CPU (~1 min)
    python bench/sim/sim_swap_vs_recompute.py --only priority  # one of the two simulated tables

1. Memory pressure (simulated): Llama-3-8B on one A100, 8 GiB of KV (65K tokens), 80 requests
   with 16K-token prompts and geometric outputs (mean 1,000) arriving at 2/s, far beyond
   what the cache holds at once: running decodes keep outgrowing the cache and are preempted.
   preemption_mode recompute, swap and auto over the A100's PCIe link (25 GB/s), then over
   slower links, where auto chooses per request, and with a host pool too small for every
   swap.
2. Priority classes (simulated): 300 requests of 2,000-token prompts, classes drawn
   REALTIME 10%, HIGH 20%, NORMAL 40%, LOW 30%, at a load the cache cannot keep up with;
   fcfs against priority (both swapping): TTFT per class.
3. --engine: the real engine (SmolLM2-135M, fp32, this CPU) with 0.03 GiB of KV for eight
   prompts of 5-600 tokens: recompute against swap, wall time and tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.runner import RunSpec, simulate
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig

PRESSURE = WorkloadConfig(
    trace="synthetic",
    prompt_len=16000,
    output_len=1000,
    output_distribution="geometric",
    qps=2.0,
    num_requests=80,
    seed=0,
)
PRESSURE_RUNS = [  # (name, scheduler overrides)
    ("recompute", dict(preemption_mode="recompute")),
    ("swap", dict(preemption_mode="swap")),
    ("auto", dict(preemption_mode="auto")),
    ("swap, 4 GB/s link", dict(preemption_mode="swap", swap_bandwidth_gbps=4.0)),
    ("auto, 4 GB/s link", dict(preemption_mode="auto", swap_bandwidth_gbps=4.0)),
    ("swap, 2.5 GB/s link", dict(preemption_mode="swap", swap_bandwidth_gbps=2.5)),
    ("auto, 2.5 GB/s link", dict(preemption_mode="auto", swap_bandwidth_gbps=2.5)),
    ("swap, 2 GB/s link", dict(preemption_mode="swap", swap_bandwidth_gbps=2.0)),
    ("auto, 2 GB/s link", dict(preemption_mode="auto", swap_bandwidth_gbps=2.0)),
    ("swap, 2 GiB host pool", dict(preemption_mode="swap", swap_space_gb=2.0)),
]
PRIORITY = WorkloadConfig(
    trace="synthetic",
    prompt_len=2000,
    output_len=500,
    output_distribution="geometric",
    qps=3.0,
    num_requests=300,
    seed=0,
    priority_mix="REALTIME:0.1,HIGH:0.2,NORMAL:0.4,LOW:0.3",
)
CLASSES = ("REALTIME", "HIGH", "NORMAL", "LOW")


def run(name: str, workload: WorkloadConfig, kv_gb: float, **sched) -> dict:
    spec = RunSpec(
        name=name,
        cluster=ClusterConfig(hardware="a100", kv_memory_gb=kv_gb),
        parallel=ParallelConfig(),
        scheduler=SchedulerConfig(**sched),
    )
    return simulate(spec, workload).summary


def pressure_table() -> tuple[str, dict]:
    rows, out = [], {}
    head = (
        "| run | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | preemptions "
        "(recompute / swap) | recomputed tokens | GB swapped out | swap time |"
    )
    rows += [head, "|" + "---|" * 10]
    for name, sched in PRESSURE_RUNS:
        s = run(name, PRESSURE, 8.0, **sched)
        out[name] = s
        p = s["preemption"]
        rows.append(
            f"| {name} | {s['throughput']['output_tokens_per_s']:.0f} | "
            f"{s['ttft_s']['p50']:.1f} s | {s['ttft_s']['p99']:.1f} s | "
            f"{s['tpot_s']['p50'] * 1e3:.1f} ms | {s['tpot_s']['p99'] * 1e3:.1f} ms | "
            f"{p['preemptions']} ({p['recomputes']} / {p['swap_outs']}) | "
            f"{p['recomputed_tokens']:,} | {p['swapped_out_bytes_per_device'] / 1e9:.1f} | "
            f"{p['swap_time_s']:.2f} s |"
        )
    return "\n".join(rows), out


def priority_table() -> tuple[str, dict]:
    rows, out = [], {}
    head = (
        "| policy | "
        + " | ".join(f"{c} TTFT p50 / p99" for c in CLASSES)
        + " | output tok/s | preemptions |"
    )
    rows += [head, "|" + "---|" * (len(CLASSES) + 3)]
    for policy in ("fcfs", "priority"):
        s = run(policy, PRIORITY, 4.0, policy=policy, preemption_mode="swap")
        out[policy] = s
        cells = []
        for c in CLASSES:
            t = s["by_priority"][c]["ttft_s"]
            cells.append(f"{t['p50']:.2f} / {t['p99']:.2f} s")
        rows.append(
            f"| {policy} | "
            + " | ".join(cells)
            + f" | {s['throughput']['output_tokens_per_s']:.0f} | "
            f"{s['preemption']['preemptions']} |"
        )
    return "\n".join(rows), out


def engine_table() -> tuple[str, dict]:
    from medha.engine.llm import LLM
    from medha.engine.sampling_params import SamplingParams

    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    params = SamplingParams(max_tokens=24, temperature=0)
    rows = [
        "| preemption | wall | preemptions (recompute / swap) | recomputed tokens | "
        "MB swapped out | tokens equal to recompute |",
        "|---|---|---|---|---|---|",
    ]
    out, first = {}, None
    for mode in ("recompute", "swap"):
        llm = LLM(
            "smollm2",
            kv_memory_gb=0.03,
            scheduler=SchedulerConfig(
                policy="fcfs", chunking="static:64", preemption_mode=mode, swap_space_gb=0.5
            ),
        )
        ids = llm.tokenizer.encode(text)
        prompts = [
            ids[i * 53 : i * 53 + n] for i, n in enumerate((5, 11, 40, 96, 170, 260, 400, 600))
        ]
        t0 = time.perf_counter()
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        wall = time.perf_counter() - t0
        st = llm.engine.scheduler.stats
        first = first or tokens
        block = llm.engine.scheduler.swap_cost.block_bytes
        out[mode] = {"wall_s": wall, **vars(st)}
        rows.append(
            f"| {mode} | {wall:.1f} s | {st.preemptions} ({st.recomputes} / "
            f"{st.swap_outs}) | {st.recomputed_tokens:,} | "
            f"{st.swapped_out_blocks * block / 1e6:.1f} | {tokens == first} |"
        )
    return "\n".join(rows), out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engine", action="store_true", help="also the CPU engine comparison")
    p.add_argument("--json", help="write every run's summary to this file")
    p.add_argument(
        "--only", choices=("pressure", "priority"), help="one of the two simulated tables"
    )
    args = p.parse_args()
    results = {}
    if args.only in (None, "pressure"):
        table, results["pressure"] = pressure_table()
        print("memory pressure: Llama-3-8B, A100, 8 GiB KV, 80 x 16K-token prompts at 2/s\n")
        print(table, "\n")
    if args.only in (None, "priority"):
        table, results["priority"] = priority_table()
        print("priority classes: 300 x 2K-token prompts at 3/s, 4 GiB KV, swap preemption\n")
        print(table, "\n")
    if args.engine:
        table, results["engine"] = engine_table()
        print(
            "engine: SmolLM2-135M fp32 on this CPU, 0.03 GiB KV, 8 prompts of 5-600 "
            "tokens, 24 greedy tokens each\n"
        )
        print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
