"""The Medha paper's parallelism figures (3b, 15-20) and its Sarathi-on-PP2 baseline, simulated.

    python bench/paper/sim_parallel_figures.py --figure 17a [--quick] [--predictor profiled]
    python bench/paper/sim_parallel_figures.py --figure all [--quick]

Figures (H100 unless said; one request unless said):
  3b          attention time of a 1M-token Llama-3-70B prefill on TP8, static chunks 32-2048
  15          MFU of Llama-3-70B prefills, TP8 x SPP 1-16, over prompt lengths
  16          MBU of one decode, TP8 x KVP 1/2/4, Llama-3-8B and 70B, 1M-10M context
  17a / 17b   SPP scaling of one prefill, TP8 x SPP 1-16 (up to 128 GPUs), 8B / 70B
  18          decode latency of one request against SPP degree, TP8, 8B and 70B
  19          decode TPOT of one request (decode-only batches) against KVP degree: 8B on
              TP8 x SPP4, 70B on TP8 x SPP8, 1M-10M context
  20          TTFT of a long prefill and P95 TBT of 4 co-batched decodes, 8B on TP4 x SPP4,
              KVP 1/2/4, static chunks 32-256, 1M/2M/4M context
  sarathi-pp  TTFT of one 400K-token prefill, 8B on A100 TP8 x PP2, static:512 / static:2048,
              stream pipeline (SPP) against microbatched PP (vLLM / Sarathi)

--quick runs each at small lengths and few degrees (seconds; what tests/test_bench_parallel.py
runs). The prefill figures run the simulator with Medha's default scheduler (lars, adaptive
chunking) and a 50 ms iteration budget, as bench/paper/sim_parallelism.py does; the decode figures
(16, 18, 19) time a decode-only batch of one request with the predictor, which is what the
simulator's TPOT of a lone decode is (its next decode joins only once its batch leaves the last
stage). "+stage overhead" columns rerun with one modelling assumption changed: every pipeline
stage pays the hardware's per-iteration host overhead (HardwareSpec.iteration_overhead_s, input
preparation and launch) for every batch, instead of the batch paying it once.

Two more one-change runs: --hardware-set KEY=VALUE replaces one field of the device's spec
(medha/perf/hardware_specs.py; e.g. mem_eff=1.0, the peak bandwidth instead of the 0.8 of it
long reads sustain, for Figure 16's MBU); --kvp-merge-us X adds X microseconds to every layer's
KVP merge (queries out to the groups, partial outputs back), on top of the two inter-node
latencies it costs otherwise, for Figures 19 and 20.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Callable

from medha.benchmark.harness import markdown_table
from medha.benchmark.parallel_bench import (
    INFEASIBLE,
    Bench,
    M,
    fmt_ms,
    fmt_s,
    kvp_layout,
    length_label,
)
from medha.benchmark.parallel_decode import fig_16, fig_18, fig_19
from medha.core.request import Request
from medha.perf import ParallelConfig, get_model
from medha.perf.hardware_specs import HardwareSpec
from medha.scheduler.config import SchedulerConfig
from medha.sim.simulator import ClusterConfig, Simulator


# ---- figures -------------------------------------------------------------------------------------
def fig_3b(b: Bench) -> str:
    """Attention time of one prefill, summed over its static chunks."""
    length = 128_000 if b.quick else M
    chunks = [32, 2048] if b.quick else [32, 64, 128, 256, 512, 1024, 2048]
    p = b.make("llama-3-70b", "h100", ParallelConfig(tp=8))
    b.note("3b", p)
    times = {}
    for c in chunks:
        times[c] = sum(p.prefill_attention_time(min(c, length - k), k) for k in range(0, length, c))
    ref = times[2048]
    rows = [[str(c), f"{times[c]:.1f} s", f"{times[c] / ref - 1:+.1%}"] for c in chunks]
    return (
        f"Fig. 3b: attention time of a {length_label(length)}-token prefill, Llama-3-70B, TP8 on 8 "
        "H100 (paper: 32-token chunks +11% over 2048)\n\n"
        + markdown_table(["chunk", "attention time", "vs 2048"], rows)
    )


def _spp_scaling(b: Bench, figure: str, model: str, lengths: list[int], spps: list[int]) -> str:
    rows = []
    for length in lengths:
        base = None
        for spp in spps:
            par = ParallelConfig(tp=8, spp=spp)
            out = b.prefill(model, length, par, figure=figure)
            gpus = str(8 * spp)
            if out is None:
                rows.append([length_label(length), str(spp), gpus, INFEASIBLE, "", "", ""])
                continue
            ttft = out[0]
            base = base or (spp, ttft)
            eff = base[0] * base[1] / (spp * ttft)
            extra = ""
            if length == lengths[0]:
                slow = b.prefill(model, length, par, stage_overhead=True, figure=figure)
                slow_base = b.prefill(
                    model, length, ParallelConfig(tp=8, spp=base[0]), True, figure
                )
                slow_eff = base[0] * slow_base[0] / (spp * slow[0])
                extra = f"{slow[0]:.1f} s, {slow_eff:.0%}"
            rows.append(
                [
                    length_label(length),
                    str(spp),
                    gpus,
                    f"{ttft:.1f} s",
                    f"{base[1] / ttft:.2f}x",
                    f"{eff:.0%}",
                    extra,
                ]
            )
    return markdown_table(
        [
            "prompt",
            "SPP",
            "GPUs",
            "TTFT",
            "speed-up",
            "scaling efficiency",
            "+stage overhead: TTFT, efficiency",
        ],
        rows,
    )


def fig_17a(b: Bench) -> str:
    lengths = [128_000] if b.quick else [M, 2 * M, 4 * M]
    spps = [1, 2, 16] if b.quick else [1, 2, 4, 8, 16]
    return (
        "Fig. 17a: SPP scaling of one prefill, Llama-3-8B, TP8 per stage, H100 (paper: near "
        "linear, > 70% at SPP16 = 128 GPUs). Efficiency against the fewest stages that fit.\n\n"
        + _spp_scaling(b, "17a", "llama-3-8b", lengths, spps)
    )


def fig_17b(b: Bench) -> str:
    lengths = [128_000] if b.quick else [M, 2 * M]
    spps = [1, 2, 16] if b.quick else [1, 2, 4, 8, 16]
    return (
        "Fig. 17b: SPP scaling of one prefill, Llama-3-70B, TP8 per stage, H100 (paper: 85% "
        "at SPP8). Efficiency against the fewest stages that fit.\n\n"
        + _spp_scaling(b, "17b", "llama-3-70b", lengths, spps)
    )


def fig_15(b: Bench) -> str:
    """MFU = model FLOPs / (TTFT x peak x GPUs), FLOPs counted two ways."""
    lengths = [64_000, 128_000] if b.quick else [256_000, 512_000, M, 2 * M]
    spps = [1, 16] if b.quick else [1, 2, 4, 8, 16]
    model = get_model("llama-3-70b")
    rows = []
    for length in lengths:
        row = [length_label(length)]
        # the paper's count (Sec. 2: 2.8 EFLOPs for 1M tokens of 70B) takes attention over the
        # whole L x L square; a causal kernel executes half of it
        causal = model.prefill_flops(length)
        square = model.linear_flops(length) + model.attention_flops(length) * 2 * length / (
            length + 1
        )
        for spp in spps:
            out = b.prefill("llama-3-70b", length, ParallelConfig(tp=8, spp=spp), figure="15")
            if out is None:
                row.append(INFEASIBLE)
                continue
            ttft, mfu = out
            row.append(f"{mfu:.0%} / {mfu * square / causal:.0%}")
        rows.append(row)
    return (
        "Fig. 15: MFU of one Llama-3-70B prefill, TP8 x SPP, H100 (paper: 50-60%, rising with "
        "length, > 50% at 128 GPUs). Each cell: causal FLOPs (the work a flash kernel executes) "
        "/ the paper's count (full L x L attention square).\n\n"
        + markdown_table(["prompt"] + [f"SPP{s} ({8 * s} GPUs)" for s in spps], rows)
    )


class _Stop(Exception):
    """Ends a simulation once the request it watches has its first token."""


DECODES = 4  # co-batched decodes in Fig. 20
DECODE_CONTEXT = 4096


def _fig20_point(b: Bench, length: int, kvp: int, chunk: int) -> tuple[float, float]:
    """(prefill time of the long request from its first chunk, P95 TBT of the decodes while
    it prefills), static:`chunk` chunking (Sarathi's budget: decodes count in it)."""
    par = kvp_layout(4, 4, kvp, length)
    p = b.make("llama-3-8b", "h100", par)
    b.note("20", p)
    sim = Simulator(
        ClusterConfig(hardware="h100"),
        par,
        SchedulerConfig(chunking=f"static:{chunk}", max_model_len=length + 16),
        predictor=p,
    )
    decodes = [Request(f"d{i}", 0.0, DECODE_CONTEXT, length // 2) for i in range(DECODES)]
    long = Request("long", 0.0, length, 1)

    def stop(r: Request, now: float) -> list[Request]:
        if r is long:
            raise _Stop
        return []

    try:
        sim.run([*decodes, long], on_finish=stop)
    except _Stop:
        pass
    else:
        raise RuntimeError("the long request never finished")
    start, end = long.first_scheduled_s, long.token_times_s[0]
    gaps = [
        b2 - a
        for d in decodes
        for a, b2 in zip(d.token_times_s, d.token_times_s[1:])
        if a >= start and b2 <= end
    ]
    p95 = statistics.quantiles(gaps, n=20, method="inclusive")[-1] if len(gaps) > 1 else math.nan
    return end - start, p95


def fig_20(b: Bench) -> str:
    lengths = [64_000] if b.quick else [M, 2 * M, 4 * M]
    kvps = [1, 2] if b.quick else [1, 2, 4]
    chunks = [128, 256] if b.quick else [32, 64, 128, 256]
    rows = []
    for length in lengths:
        for kvp in kvps:
            row = [length_label(length), str(kvp)]
            for chunk in chunks:
                ttft, tbt = _fig20_point(b, length, kvp, chunk)
                row.append(f"{fmt_s(ttft)}, {fmt_ms(tbt)}")
            rows.append(row)
    return (
        f"Fig. 20: TTFT of one long prefill and P95 TBT of {DECODES} decodes at "
        f"{DECODE_CONTEXT} tokens of context running beside it, Llama-3-8B, TP4 x SPP4, H100, "
        "fcfs with static chunks (the budget counts the decodes), KVP groups of prompt / kvp "
        "tokens. Each cell: TTFT (from its first chunk), P95 TBT while it prefills.\n\n"
        + markdown_table(["prompt", "KVP"] + [f"chunk {c}" for c in chunks], rows)
    )


def fig_sarathi_pp(b: Bench) -> str:
    """One long prefill on Sarathi's TP8 x PP2: chunk i+1 overlapping chunk i (stream) or not
    (microbatch), with PP1 on 8 GPUs for reference."""
    length = 64_000 if b.quick else 400_000
    rows = []
    for chunk in (512, 2048):
        times = {}
        for label, spp, pipeline in (
            ("PP1 (8 GPUs)", 1, "stream"),
            ("PP2 stream", 2, "stream"),
            ("PP2 microbatch", 2, "microbatch"),
        ):
            par = ParallelConfig(tp=8, spp=spp)
            p = b.make("llama-3-8b", "a100", par)
            b.note("sarathi-pp", p)
            sim = Simulator(
                ClusterConfig(hardware="a100"),
                par,
                SchedulerConfig(policy="fcfs", chunking=f"static:{chunk}", pipeline=pipeline),
                predictor=p,
            )
            r = Request("long", 0.0, length, 1)
            sim.run([r])
            times[label] = r.ttft_s
        ref = times["PP2 stream"]
        rows += [
            [f"static:{chunk}", label, f"{t:.1f} s", f"{t / ref:.2f}x"]
            for label, t in times.items()
        ]
    return (
        f"Sarathi on TP8 x PP2: TTFT of one {length_label(length)}-token prefill, Llama-3-8B, "
        "A100, fcfs, static chunks\n\n"
        + markdown_table(["chunking", "pipeline", "TTFT", "vs PP2 stream"], rows)
    )


FIGURES: dict[str, Callable[[Bench], str]] = {
    "3b": fig_3b,
    "15": fig_15,
    "16": fig_16,
    "17a": fig_17a,
    "17b": fig_17b,
    "18": fig_18,
    "19": fig_19,
    "20": fig_20,
    "sarathi-pp": fig_sarathi_pp,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--figure", choices=[*FIGURES, "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="small lengths and degrees (seconds)")
    ap.add_argument(
        "--predictor",
        default="profiled",
        help="batch-time model (default: profiled, the bundled fits where they cover the model "
        "and GPU: A100 MLPs of Llama-3-8B/70B, A100 and H100 collectives; roofline elsewhere)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.05,
        help="Medha's iteration budget in the prefill figures (15, 17a, 17b; default 0.05 s, "
        "bench/paper/sim_parallelism.py's)",
    )
    ap.add_argument(
        "--hardware-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace one field of the hardware spec (a one-change run; e.g. mem_eff=1.0)",
    )
    ap.add_argument(
        "--kvp-merge-us",
        type=float,
        default=0.0,
        help="microseconds added to every layer's KVP merge (a one-change run; default 0)",
    )
    args = ap.parse_args(argv)
    fields = {f.name: f.type for f in dataclasses.fields(HardwareSpec)}
    hardware_set = {}
    for item in args.hardware_set:
        key, sep, value = item.partition("=")
        if not sep or key not in fields or key == "name":
            ap.error(f"--hardware-set wants FIELD=NUMBER, a field of HardwareSpec, got {item!r}")
        try:
            hardware_set[key] = float(value) if "float" in str(fields[key]) else int(value)
        except ValueError:
            ap.error(f"--hardware-set {key}: not a number: {value!r}")
    b = Bench(args.predictor, args.quick, args.budget_s, hardware_set, args.kvp_merge_us * 1e-6)
    for name in FIGURES if args.figure == "all" else [args.figure]:
        print(FIGURES[name](b))
        used = b.used.get(name, {})
        for what in sorted(set(used.values())):
            models = ", ".join(m for m, w in used.items() if w == what)
            print(f"\npredictor: {what}; {models}")
        print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
