"""bench/paper/sim_parallel_figures.py's decode figures (16, 18, 19): the time of a decode-only
batch of one request read off the predictor, which is what the simulator's TPOT of a lone decode is
(its next decode joins only once its batch leaves the last stage), against KVP and SPP degree.
"""

from __future__ import annotations

from medha.benchmark.harness import markdown_table
from medha.benchmark.parallel_bench import (
    INFEASIBLE,
    Bench,
    M,
    fmt_ms,
    kvp_layout,
    length_label,
)
from medha.perf import ParallelConfig, get_model


def fig_16(b: Bench) -> str:
    """MBU = (weights + KV bytes read) / (TPOT x bandwidth x GPUs), one decode."""
    contexts = [M, 2 * M] if b.quick else [M, 2 * M, 4 * M, 10 * M]
    kvps = [1, 2] if b.quick else [1, 2, 4]
    rows = []
    for name in ("llama-3-8b", "llama-3-70b"):
        model = get_model(name)
        for ctx in contexts:
            row = [name, length_label(ctx)]
            for kvp in kvps:
                par = kvp_layout(8, 1, kvp, ctx)
                if b.capacity(name, "h100", par) < ctx + 1:
                    row.append(INFEASIBLE)
                    continue
                p = b.make(name, "h100", par)
                b.note("16", p)
                t = b.decode_s(p, ctx)
                hw = p.hardware
                nbytes = model.num_params * hw.dtype_bytes + ctx * model.kv_bytes_per_token(
                    hw.dtype_bytes
                )
                row.append(f"{fmt_ms(t)}, {nbytes / (t * hw.mem_bw * par.world_size):.0%}")
            rows.append(row)
    return (
        "Fig. 16: MBU of one decode (decode-only batch), TP8 x KVP, H100, KVP groups of "
        "context / kvp tokens "
        "(paper: up to 92%). Each cell: TPOT, MBU over all tp x kvp GPUs.\n\n"
        + markdown_table(["model", "context"] + [f"KVP{k}" for k in kvps], rows)
    )


def fig_18(b: Bench) -> str:
    contexts = [4096] if b.quick else [4096, M]
    spps = [1, 8] if b.quick else [1, 2, 4, 8, 16]
    rows = []
    for name in ("llama-3-8b", "llama-3-70b"):
        for ctx in contexts:
            base = slow_base = None
            row = [name, length_label(ctx) if ctx >= 1000 else str(ctx)]
            for spp in spps:
                par = ParallelConfig(tp=8, spp=spp)
                if b.capacity(name, "h100", par) < ctx + 1:
                    row.append(INFEASIBLE)
                    continue
                p = b.make(name, "h100", par)
                b.note("18", p)
                t = b.decode_s(p, ctx)
                slow = b.decode_s(b.make(name, "h100", par, stage_overhead=True), ctx)
                base, slow_base = base or t, slow_base or slow
                row.append(f"{fmt_ms(t)} ({t / base - 1:+.0%}); {slow / slow_base - 1:+.0%}")
            rows.append(row)
    return (
        "Fig. 18: decode latency of one request (decode-only batch) against SPP degree, TP8, "
        "H100 (paper: +16% at SPP8). Each cell: latency (change vs SPP1); change with every "
        "stage paying the host overhead.\n\n"
        + markdown_table(["model", "context"] + [f"SPP{s}" for s in spps], rows)
    )


def fig_19(b: Bench) -> str:
    contexts = [M, 2 * M] if b.quick else [M, 2 * M, 4 * M, 10 * M]
    kvps = [1, 2] if b.quick else [1, 2, 4]
    rows = []
    for name, spp in (("llama-3-8b", 4), ("llama-3-70b", 8)):
        for ctx in contexts:
            row = [f"{name}, SPP{spp}", length_label(ctx)]
            times = {}
            for kvp in kvps:
                par = kvp_layout(8, spp, kvp, ctx)
                if b.capacity(name, "h100", par) < ctx + 1:
                    row.append(INFEASIBLE)
                    continue
                p = b.make(name, "h100", par)
                b.note("19", p)
                times[kvp] = b.decode_s(p, ctx)
                row.append(fmt_ms(times[kvp]))
            for kvp in kvps[1:]:
                ok = kvp in times and 1 in times
                row.append(f"{times[kvp] / times[1] - 1:+.0%}" if ok else "")
            rows.append(row)
    return (
        "Fig. 19: decode TPOT of one request in decode-only batches against KVP degree, TP8, "
        "H100, KVP groups of context / kvp tokens (paper, 8B at 10M: about -40% with KVP2 in the "
        "caption, "
        "-40% with KVP4 in the text).\n\n"
        + markdown_table(
            ["model", "context"] + [f"KVP{k}" for k in kvps] + [f"KVP{k} vs 1" for k in kvps[1:]],
            rows,
        )
    )
