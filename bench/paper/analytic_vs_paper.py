"""The analytic model against figures quoted in the Medha paper.

    python bench/paper/analytic_vs_paper.py

Prints a markdown table: claim, paper, ours, ratio, and whether ours is within 2x.
"""

from __future__ import annotations

from medha.perf import ParallelConfig, get_model, make_predictor
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.packers import make_packer

H100_PEAK = 989e12


def chunked_attention(pred, chunk: int, n: int) -> float:
    return sum(pred.prefill_attention_time(min(chunk, n - k), k) for k in range(0, n, chunk))


def main() -> None:
    rows = []
    m70 = get_model("llama-3-70b")
    n = 10**6
    executed = m70.prefill_flops(n)
    full = m70.linear_flops(n) + 2 * m70.attention_flops(n)
    rows.append(
        (
            "1M-token prefill, Llama-3-70B (causal work executed)",
            "2.8 EFLOP",
            f"{executed / 1e18:.2f} EFLOP",
            executed / 2.8e18,
        )
    )
    rows.append(
        (
            "same, counting the full n^2 score matrix",
            "2.8 EFLOP",
            f"{full / 1e18:.2f} EFLOP",
            full / 2.8e18,
        )
    )
    rows.append(
        (
            "time at H100 peak, executed work",
            ">= 48 min",
            f"{executed / H100_PEAK / 60:.1f} min",
            executed / H100_PEAK / 60 / 48,
        )
    )

    p70 = make_predictor("roofline", m70, "h100", ParallelConfig(tp=8))
    a32, a2048 = chunked_attention(p70, 32, n), chunked_attention(p70, 2048, n)
    rows.append(
        (
            "attention of a 1M prompt, 32- vs 2048-token chunks (70B, 8xH100 TP8)",
            "+11%",
            f"+{a32 / a2048 - 1:.1%} ({a32:.0f} s vs {a2048:.0f} s)",
            (a32 / a2048 - 1) / 0.11,
        )
    )

    p8 = make_predictor("roofline", "llama-3-8b", "h100", ParallelConfig(tp=8))
    mixed = p8.shape_time([(512, n)], [4096] * 32)
    rows.append(
        (
            "mixed iteration: 512-token chunk at 1M context + 32 decodes (8B, 8xH100 TP8)",
            "~250 ms",
            f"{mixed * 1e3:.0f} ms",
            mixed / 0.25,
        )
    )
    alt70 = p70.shape_time([(512, n)], [4096] * 32)
    rows.append(
        (
            "  same iteration with Llama-3-70B (8xH100 TP8), for reference",
            "~250 ms",
            f"{alt70 * 1e3:.0f} ms",
            alt70 / 0.25,
        )
    )

    packer = make_packer(SchedulerConfig(iteration_budget_s=0.05), p8)
    k, chunks = 0, []
    while k < n:
        c = packer.plan_isolated(k, n - k)
        chunks.append(c)
        k += c
    rows.append(
        (
            "adaptive chunks of a 1M prefill, 50 ms budget (8B, TP8): first / last full",
            "shrinking",
            f"{chunks[0]} / {chunks[-2]} tokens ({len(chunks)} chunks)",
            None,
        )
    )

    print("| figure | paper | ours | ours / paper | within 2x |")
    print("|---|---|---|---|---|")
    for name, paper, ours, ratio in rows:
        ok = "" if ratio is None else ("yes" if 0.5 <= ratio <= 2 else "**no**")
        r = "" if ratio is None else f"{ratio:.2f}"
        print(f"| {name} | {paper} | {ours} | {r} | {ok} |")


if __name__ == "__main__":
    main()
