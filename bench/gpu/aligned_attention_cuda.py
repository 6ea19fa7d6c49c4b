"""AlignedServe's Figure 1 batches on a GPU: does decode attention follow the sum of the KV reads,
its longest sequence's thread block, or the batch padded to its longest context?

    python bench/gpu/aligned_attention_cuda.py [--out results.json]

One layer of Llama-2-7B decode attention (32 heads of 128, fp16) over 64 sequences at 600
generated tokens: 64 of 32-token prompts, or 1, 2, 4 of them 4096-token prompts. Three kernels:
- v1-style: a Triton kernel with one program of 4 warps (vLLM paged_attention_v1's 128 threads)
  per (sequence, head), walking that sequence's KV 16 tokens at a time;
- padded: torch scaled_dot_product_attention over the batch padded to its longest context;
- probe: the v1-style kernel on one 4696-token sequence alone (32 programs), whose time is one
  thread block's streaming rate (medha/perf/cta_predictor.py takes 27.3 GB/s from Little's law),
  then on four of them, then on one beside 64 short ones;
- Figure 3: 64 batches of one prompt length each (10, 70, ..., 3790) against one batch of every
  length, with both kernels.
The run in docs/reproductions.md was this script's code sent to the lent H100 (and H200) in one
command.
Needs CUDA, torch and triton; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from medha.benchmark.harness import add_common_args

HEADS, DIM, LAYERS = 32, 128, 32
SHORT, LONG, GEN = 32, 4096, 600


@triton.jit
def _v1(Q, K, V, Out, starts, lens, scale, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(starts + s)
    n = tl.load(lens + s)
    d = tl.arange(0, D)
    q = tl.load(Q + (s * H + h) * D + d).to(tl.float32)
    m = tl.zeros([], dtype=tl.float32) - 1e30
    den = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for t0 in range(0, n, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        mask = t < n
        offs = ((start + t)[:, None] * H + h) * D + d[None, :]
        k = tl.load(K + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        sc = tl.where(mask, tl.sum(k * q[None, :], 1) * scale, -1e30)
        m_new = tl.maximum(m, tl.max(sc, 0))
        p = tl.exp(sc - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(V + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        den = den * alpha + tl.sum(p, 0)
        m = m_new
    tl.store(Out + (s * H + h) * D + d, (acc / den).to(tl.float16))


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3  # seconds


def v1_time(lens: list[int]) -> float:
    total = sum(lens)
    k = torch.randn(total, HEADS, DIM, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), HEADS, DIM, device="cuda", dtype=torch.float16)
    o = torch.empty_like(q)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], device="cuda")
    n = torch.tensor(lens, device="cuda")
    grid = (len(lens), HEADS)
    return timed(lambda: _v1[grid](q, k, v, o, starts, n, DIM**-0.5, HEADS, DIM, 16, num_warps=4))


def padded_time(lens: list[int]) -> float:
    b, longest = len(lens), max(lens)
    k = torch.randn(b, HEADS, longest, DIM, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(b, HEADS, 1, DIM, device="cuda", dtype=torch.float16)
    mask = (
        torch.arange(longest, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
    )
    mask = mask[:, None, None, :]
    f = torch.nn.functional.scaled_dot_product_attention
    return timed(lambda: f(q, k, v, attn_mask=mask))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, out=None)
    args = ap.parse_args()
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    rows = {}
    for longs in (0, 1, 2, 4):
        lens = [SHORT + GEN] * (64 - longs) + [LONG + GEN] * longs
        kv_bytes = sum(lens) * HEADS * DIM * 2 * 2
        t1, tp = v1_time(lens), padded_time(lens)
        rows[longs] = {"v1_s": t1, "padded_s": tp, "kv_bytes": kv_bytes}
        print(
            f"{64 - longs} short + {longs} long: v1-style {1e6 * t1:.1f} us/layer "
            f"({kv_bytes / t1 / 1e9:.0f} GB/s), padded sdpa {1e6 * tp:.1f} us/layer; "
            f"x{LAYERS} layers: {1e3 * LAYERS * t1:.2f} / {1e3 * LAYERS * tp:.2f} ms",
            flush=True,
        )
    cta_bytes = (LONG + GEN) * DIM * 2 * 2
    probes = {}
    for lens in ([LONG + GEN], [LONG + GEN] * 4, [SHORT + GEN] * 64 + [LONG + GEN]):
        t = v1_time(lens)
        probes[len(lens)] = t
        print(
            f"probe, {len(lens)} sequences (one or more {LONG + GEN}-token): {1e6 * t:.1f} us, "
            f"{cta_bytes / t / 1e9:.1f} GB/s per program of the long sequence",
            flush=True,
        )
    out.update(rows=rows, probes_s=probes, cta_rate=cta_bytes / probes[1])
    # Figure 3: 64 one-length batches (10, 70, ..., 3790 tokens) against one of every length
    groups = list(range(10, 3791, 60))
    one = {k: [f([g] * 64) for g in groups] for k, f in (("v1", v1_time), ("padded", padded_time))}
    mixed = {"v1": v1_time(groups), "padded": padded_time(groups)}
    for k in one:
        mean = sum(one[k]) / len(one[k])
        print(
            f"figure 3, {k}: one length a batch {1e6 * mean:.1f} us/layer (mean), every length "
            f"{1e6 * mixed[k]:.1f} us/layer, ratio {mixed[k] / mean:.3f}",
            flush=True,
        )
    out.update(figure3={"one_length_s": one, "mixed_s": mixed})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
