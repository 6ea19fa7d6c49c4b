"""Swap preemption on a CUDA GPU: the host link's speed, the engine's block copies, and (with
--model) greedy tokens of a pressured swapping run against an unpressured one.

    python bench/gpu/kv_swap_cuda.py                          # bandwidth and HostKVBlocks copies
    python bench/gpu/kv_swap_cuda.py --model DIR --dtype float32   # plus the engine on DIR

DIR: a small Llama checkpoint, e.g. the tiny random one the tests
builds (the `tiny_model` fixture in tests/conftest.py: 2 layers, SmolLM2's tokenizer), saved to a
folder.
The KV layout is Llama-3-8B's (32 layers, 8 KV heads of 128, bf16, 16-token blocks: 2 MiB a
block), in the engine's own tensors ([2 * kv_heads, slots, head_dim] per layer: K, then V).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from medha.engine.host_kv import HostKVBlocks


def _timed(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def link_bandwidth(nbytes: int = 1 << 30) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    out = {}
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        d2h = _timed(lambda h=host: h.copy_(dev, non_blocking=True))
        h2d = _timed(lambda h=host: dev.copy_(h, non_blocking=True))
        out[f"d2h_{name}_gbps"], out[f"h2d_{name}_gbps"] = nbytes / d2h / 1e9, nbytes / h2d / 1e9
    return out


def host_kv_cache(num_blocks: int = 4096, moved: int = 512, bs: int = 16) -> dict:
    layers, kvh, hd = 32, 8, 128
    # per layer one tensor, its K heads then its V heads, as the engine holds them
    caches = [
        torch.randn(2 * kvh, num_blocks * bs, hd, device="cuda", dtype=torch.bfloat16)
        for _ in range(layers)
    ]
    host = HostKVBlocks(caches, num_blocks=moved, block_size=bs)
    block_bytes = 2 * layers * kvh * hd * 2 * bs
    src = list(range(1, 2 * moved, 2))  # every other block: a fragmented cache
    dst = list(range(2, 2 * moved + 1, 2))
    hosts = list(range(moved))
    expect = [t.unflatten(1, (-1, bs))[:, src].clone() for t in caches]
    out_s = _timed(lambda: host.swap_out(src, hosts))
    in_s = _timed(lambda: host.swap_in(hosts, dst))
    got = [t.unflatten(1, (-1, bs))[:, dst] for t in caches]
    exact = all(torch.equal(a, b) for a, b in zip(expect, got))
    nbytes = moved * block_bytes
    return {
        "blocks": moved,
        "bytes": nbytes,
        "pinned": host.host.is_pinned(),
        "swap_out_s": out_s,
        "swap_in_s": in_s,
        "swap_out_gbps": nbytes / out_s / 1e9,
        "swap_in_gbps": nbytes / in_s / 1e9,
        "exact": exact,
    }


def engine_tokens(model: str, dtype: str) -> dict:
    from medha.engine.llm import LLM
    from medha.engine.sampling_params import SamplingParams
    from medha.scheduler.config import SchedulerConfig

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    text = " ".join(
        f"Entry {i}: the ferry from {i * 5 % 17} to {i * 3 % 7} left at {i % 12} "
        "o'clock with cars, bikes and crates of apples."
        for i in range(40)
    )
    a = json.load(open(f"{model}/config.json"))
    kv_block = (
        2
        * a["num_hidden_layers"]
        * a["num_key_value_heads"]
        * (a["hidden_size"] // a["num_attention_heads"])
        * torch.finfo(getattr(torch, dtype)).bits
        // 8
        * 16
    )
    result = {}
    # 43 blocks (688 tokens) for seven requests that need 1,150 in all
    for name, mode, blocks in (
        ("unpressured", "recompute", 4096),
        ("swap", "swap", 43),
        ("recompute", "recompute", 43),
    ):
        llm = LLM(
            model,
            scheduler=SchedulerConfig(
                policy="fcfs", chunking="static:64", preemption_mode=mode, host_kv_blocks=64
            ),
            device="cuda",
            dtype=dtype,
            kv_memory_gb=blocks * kv_block / 2**30,
        )
        ids = llm.tokenizer.encode(text)
        prompts = [ids[i * 37 : i * 37 + n] for i, n in enumerate((5, 11, 40, 96, 170, 260, 400))]
        t0 = time.perf_counter()
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        st = llm.engine.scheduler.stats
        result[name] = {
            "tokens": outs,
            "wall_s": time.perf_counter() - t0,
            "swap_outs": st.swap_outs,
            "recomputes": st.recomputes,
        }
    ref = result["unpressured"]["tokens"]
    return {
        k: {
            **{x: y for x, y in v.items() if x != "tokens"},
            "identical_to_unpressured": v["tokens"] == ref,
        }
        for k, v in result.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="a small Llama checkpoint directory for the engine check")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    print(json.dumps({"link": link_bandwidth(), "host_kv_cache": host_kv_cache()}, indent=1))
    if args.model:
        print(json.dumps({"engine": engine_tokens(args.model, args.dtype)}, indent=1))


if __name__ == "__main__":
    main()
