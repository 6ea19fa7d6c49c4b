"""The Medha paper's back-of-the-envelope claims, from the model specs and the hardware specs.

    python bench/paper/medha_paper_arithmetic.py

- Section 2.2: a 1M-token prefill of Llama-3-70B needs 2.8 ExaFLOPs (at least 48 minutes on one
  H100): ours, causal and counting the whole attention square.
- Section 2.6: a 512-token chunk at 1M context (Llama-3-8B, 8 H100s) makes an iteration of about
  250 ms: the roofline's time, the attention's time at the devices' peak FLOPs, and the one
  assumption changed: the roofline takes the attention kernel to keep every SM busy; a kernel
  that parallelises over query tiles and heads only (FlashAttention-2's forward grid: 128-row
  query tiles x query heads x sequences, no split of the KV) runs this shape on
  ceil(512 / 128) x 4 heads per device = 16 thread blocks, one SM each, of the H100's 132.
- Figure 10: Sarathi's TPOT "as high as 1 s": the time of its deepest static:2048 chunk, at
  full occupancy and on the query-tile grid.
- The convoy runs' load (Figures 1, 9): the rate at which ShareGPT with 5% Medha-SWE requests
  saturates 16 A100s, at their peak FLOPs and at the MFU the paper reports (50-60%).
"""

from __future__ import annotations

from medha.perf import ParallelConfig, make_predictor
from medha.perf.hardware_specs import get_hardware
from medha.perf.model_specs import get_model
from medha.sim.workload.generator import WorkloadConfig, build_requests

# public facts for Section 2.6's one-change run: the H100 SXM's streaming multiprocessors, and
# the query rows of one thread block of FlashAttention-2's forward kernel at head_dim 128 on
# sm80/sm90 (Flash_fwd_kernel_traits<128, 128, 64, 4> in flash_fwd_launch_template.h)
H100_SMS = 132
A100_SMS = 108
FA2_QUERY_TILE = 128


def grid_iteration(p, chunk: int, kv: int, sms: int) -> tuple[float, float, float, int]:
    """(iteration, its attention, that attention on a query-tile x head grid, thread blocks) of
    one prefill chunk of `chunk` tokens after `kv` cached, predictor `p`: the grid's blocks run
    one to an SM, so the attention takes sms / blocks of the full-occupancy time; the grid's
    iteration is the iteration with the one attention swapped for the other."""
    attn = p.prefill_attention_time(chunk, kv)
    blocks = -(-chunk // FA2_QUERY_TILE) * (p.model.num_heads // p.parallel.tp)
    return p.shape_time([(chunk, kv)], []), attn, attn * sms / min(blocks, sms), blocks


def main() -> None:
    m70, h100 = get_model("llama-3-70b"), get_hardware("h100")
    n = 1_000_000
    causal = m70.prefill_flops(n)
    square = m70.linear_flops(n) + 2 * m70.attention_flops(n)
    print("Section 2.2: Llama-3-70B, 1M-token prefill")
    print(
        f"  causal: {causal / 1e18:.2f} EFLOPs, {causal / h100.peak_flops / 60:.0f} min on one H100"
    )
    print(
        f"  the whole attention square: {square / 1e18:.2f} EFLOPs, "
        f"{square / h100.peak_flops / 60:.0f} min (paper: 2.8 EFLOPs, >= 48 min)"
    )

    m8 = get_model("llama-3-8b")
    p = make_predictor("roofline", "llama-3-8b", "h100", ParallelConfig(tp=8))
    chunk, kv = 512, 1_000_000
    t, full, grid_attn, blocks = grid_iteration(p, chunk, kv, H100_SMS)
    # attention FLOPs of the chunk against its KV: 4 x chunk x kv x heads x head_dim per layer
    attn = 4 * chunk * kv * m8.num_heads * m8.head_dim * m8.num_layers
    print("\nSection 2.6: Llama-3-8B, 8 H100s, a 512-token chunk at 1M context")
    print(
        f"  roofline iteration: {t * 1e3:.0f} ms; its attention at peak FLOPs: "
        f"{attn / (8 * h100.peak_flops) * 1e3:.0f} ms (paper: ~250 ms)"
    )
    print(
        f"  the same with the attention on a query-tile x head grid ({blocks} thread blocks of "
        f"{H100_SMS} SMs busy): attention {full * 1e3:.0f} -> {grid_attn * 1e3:.0f} ms, "
        f"iteration {(t - full + grid_attn) * 1e3:.0f} ms"
    )
    sarathi = make_predictor("profiled", "llama-3-8b", "a100", ParallelConfig(tp=8, spp=2))
    t, attn, grid_attn, blocks = grid_iteration(sarathi, 2048, 1_000_000, A100_SMS)
    grid = t - attn + grid_attn
    print("\nFigure 10: Sarathi static:2048 on A100 TP8 x PP2, its deepest chunk (at 1M context)")
    print(
        f"  iteration through both stages: {t:.2f} s; on a query-tile x head grid ({blocks} "
        f"thread blocks of {A100_SMS} SMs): {grid:.2f} s (paper: TPOT as high as ~1 s)"
    )

    a100 = get_hardware("a100")
    reqs = build_requests(
        WorkloadConfig(trace="sharegpt", qps=1.0, num_requests=20000, long_fraction=0.05, seed=1),
        m8.max_context,
    )
    flops = sum(m8.prefill_flops(r.prompt_len) + 2 * m8.num_params * r.max_tokens for r in reqs)
    per_request = flops / len(reqs)
    peak = 16 * a100.peak_flops
    print("\nConvoy runs: ShareGPT + 5% Medha-SWE, Llama-3-8B on 16 A100s")
    print(f"  model FLOPs per request (prefill + decode, mean of 20,000): {per_request:.3g}")
    for mfu in (1.0, 0.6, 0.5):
        print(f"  saturates at {peak * mfu / per_request:.2f} QPS at {mfu:.0%} MFU")


if __name__ == "__main__":
    main()
