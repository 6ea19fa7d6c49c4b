"""Eager launches against CUDA-graph replay for short prefill batches, on a CUDA GPU: the
physical numbers behind `--predictor roofline-graph` (medha/perf/graph_predictor.py).

    python bench/gpu/cuda_graph_prefill.py [--model qwen2.5-7b] [--out graph_prefill.json]

A decoder of the model's shapes (every layer, bf16, random weights; the LM head on each
sequence's last token) runs a prefill of B prompts of L tokens each (no history) three ways:
eager with a synchronize at the end (what a step costs when launched op by op), eager without
the synchronize (the host's time to issue the step's kernels), and as a replayed CUDA graph
captured for that (L, B) shape. It also times a stream of tiny kernels (the host's cost of one
launch from PyTorch) and counts the kernels one layer launches (torch.profiler). The ratio of
eager to graph time, shape by shape, is what the graph predictor's launch model must show.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from medha.benchmark.harness import add_common_args
from medha.perf.model_specs import get_model

LENGTHS = (8, 16, 32, 64, 128, 256)
SIZES = (1, 4, 16, 64)


class Layer:
    def __init__(self, m, dev) -> None:
        h, q, kv, i = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
        w = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16) / math.sqrt(s[-1])  # noqa: E731
        self.wqkv, self.bqkv = (
            w(q + 2 * kv, h),
            torch.zeros(q + 2 * kv, device=dev, dtype=torch.bfloat16),
        )
        self.wo, self.wgu, self.wd = w(h, q), w(2 * i, h), w(h, i)
        self.n1 = torch.ones(h, device=dev, dtype=torch.bfloat16)
        self.n2 = torch.ones(h, device=dev, dtype=torch.bfloat16)
        self.m = m

    def __call__(self, x, cos, sin, B, L):
        m = self.m
        r = x
        x = F.rms_norm(x, (m.hidden_size,), self.n1, 1e-6)
        qkv = F.linear(x, self.wqkv, self.bqkv)
        q, k, v = qkv.split([m.q_size, m.kv_size, m.kv_size], -1)
        q = q.view(B, L, m.num_heads, m.head_dim)
        k = k.view(B, L, m.num_kv_heads, m.head_dim)
        v = v.view(B, L, m.num_kv_heads, m.head_dim)
        half = m.head_dim // 2
        q = torch.cat(
            (q[..., :half] * cos - q[..., half:] * sin, q[..., half:] * cos + q[..., :half] * sin),
            -1,
        )
        k = torch.cat(
            (k[..., :half] * cos - k[..., half:] * sin, k[..., half:] * cos + k[..., :half] * sin),
            -1,
        )
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        x = r + F.linear(o.transpose(1, 2).reshape(B * L, m.q_size), self.wo)
        r = x
        x = F.rms_norm(x, (m.hidden_size,), self.n2, 1e-6)
        g, u = F.linear(x, self.wgu).chunk(2, -1)
        return r + F.linear(F.silu(g) * u, self.wd)


class Model:
    def __init__(self, m, dev) -> None:
        self.m, self.layers = m, [Layer(m, dev) for _ in range(m.num_layers)]
        self.head = torch.randn(m.vocab_size, m.hidden_size, device=dev, dtype=torch.bfloat16) / 64
        self.nf = torch.ones(m.hidden_size, device=dev, dtype=torch.bfloat16)

    def __call__(self, x, cos, sin, B, L):
        for layer in self.layers:
            x = layer(x, cos, sin, B, L)
        last = x.view(B, L, -1)[:, -1]
        return F.linear(F.rms_norm(last, (self.m.hidden_size,), self.nf, 1e-6), self.head).argmax(
            -1
        )


def _best(fn, repeats: int, sync: bool = True) -> float:
    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best


def launch_cost(n: int = 2000) -> float:
    """Host seconds per tiny kernel launched from PyTorch (x.add_(1), issued back to back)."""
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    return issued / n


def kernels_per_layer(model: Model, args) -> int:
    from torch.profiler import ProfilerActivity, profile

    one = Model.__new__(Model)
    one.m, one.layers, one.head, one.nf = model.m, model.layers[:1], model.head, model.nf
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one(*args)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof0:
        Model.__call__(
            type("Z", (), {"layers": [], "m": model.m, "head": model.head, "nf": model.nf})(), *args
        )
        torch.cuda.synchronize()
    count = lambda p: sum(e.count for e in p.key_averages() if e.device_type.name == "CUDA")  # noqa: E731
    return count(prof) - count(prof0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="qwen2.5-7b")
    add_common_args(ap, out="graph_prefill.json")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    m = get_model(args.model)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    model = Model(m, dev)
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": m.name,
        "launch_s": launch_cost(),
        "shapes": [],
    }
    pool = torch.cuda.graph_pool_handle()
    for L in LENGTHS:
        for B in SIZES:
            x = torch.randn(B * L, m.hidden_size, device=dev, dtype=torch.bfloat16)
            cos = torch.randn(1, L, 1, m.head_dim // 2, device=dev, dtype=torch.bfloat16)
            sin = torch.randn(1, L, 1, m.head_dim // 2, device=dev, dtype=torch.bfloat16)
            a = (x, cos, sin, B, L)
            with torch.no_grad():
                if "kernels_per_layer" not in out:
                    try:
                        out["kernels_per_layer"] = kernels_per_layer(model, a)
                    except Exception as e:  # the profiler is optional
                        out["kernels_per_layer"] = f"not counted: {e!r}"
                for _ in range(2):
                    model(*a)
                eager = _best(lambda a=a: model(*a), args.repeats)
                issue = _best(lambda a=a: model(*a), args.repeats, sync=False)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    model(*a)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                c0 = time.perf_counter()
                with torch.cuda.graph(g, pool=pool):
                    model(*a)
                torch.cuda.synchronize()
                capture = time.perf_counter() - c0
                graph = _best(g.replay, 2 * args.repeats)
                replay_issue = _best(g.replay, args.repeats, sync=False)
                del g
            row = dict(
                L=L,
                B=B,
                eager_s=eager,
                eager_issue_s=issue,
                graph_s=graph,
                graph_issue_s=replay_issue,
                capture_s=capture,
            )
            out["shapes"].append(row)
            print(json.dumps(row), flush=True)
    out["wall_s"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "shapes"}))


if __name__ == "__main__":
    main()
