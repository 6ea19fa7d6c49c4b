"""The rows of bench/gpu/engine_device.py, each measured in one worker process: medha's engine
against the device's limits (decode1, decode64, prefill: the weights' and KV's read time, the
FLOP rate), the chunking and convoy rows, the aten calls of a lone decode step, and
transformers on the same weights (hf); `worker` runs the rows asked for, a failing row kept as
a finding.

bench/gpu/engine_device.py loads this file by its path, and in an A/B run (--against) its worker
imports another checkout's medha: so this module imports medha only inside its functions, and
whatever medha is on the path is the one measured.
"""

# ruff: noqa: E501  (a measuring script's rows: its lines are wide)
from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time

ROWS = ("aten", "decode1", "decode64", "prefill", "chunking", "convoy", "hf")


@dataclasses.dataclass
class Sizes:
    """The rows' sizes: CUDA's (an 8B model), a CPU's (SmolLM2-135M on two cores), --quick's."""

    decode_ctx: int = 1024
    decode_out: int = 129
    wide: int = 64
    wide_prompt: int = 512
    wide_out: int = 129
    prefill: int = 8192
    longs: tuple[int, ...] = (32768, 120000)
    short: int = 256
    short_out: int = 32
    shorts: int = 8

    @classmethod
    def for_device(cls, device: str, quick: bool) -> Sizes:
        if quick:
            return cls(64, 9, 4, 32, 5, 256, (512,), 32, 4, 3)
        if device == "cuda":
            return cls()
        return cls(1024, 65, 64, 128, 33, 2048, (4096, 8000))


# ---- one contender (a worker process) -------------------------------------------------------
def engine(a, policy="fcfs", chunking="none", **overrides):
    """An engine with medha's defaults but the bench's model, device, dtype, kernels and
    whatever `overrides` name (only fields this checkout's EngineConfig has)."""
    from medha.engine.config import EngineConfig
    from medha.engine.llm_engine import LLMEngine
    from medha.scheduler.config import SchedulerConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    given = dict(model=a.model, device=a.device, dtype=a.dtype, kernels=a.kernels)
    if a.kv_memory_gb is not None:
        given["kv_memory_gb"] = a.kv_memory_gb
    if a.self_profile_s is not None:
        given["self_profile_s"] = a.self_profile_s
    given.update(a.engine_args, **overrides)
    for key in sorted(set(a.engine_args) - fields):
        print(f"--engine-arg {key}: this checkout's EngineConfig has no such field, left out")
    config = EngineConfig(**{k: v for k, v in given.items() if k in fields and v is not None})
    return LLMEngine(config, SchedulerConfig(policy=policy, chunking=chunking, prefix_cache="off"))


def release() -> None:
    """After the caller dropped its engine: an engine's memory goes only with the garbage
    collector (a reference cycle)."""
    gc.collect()
    if torch_cuda():
        import torch

        torch.cuda.empty_cache()


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def drain(e, arrivals, device) -> dict:
    """medha.benchmark.arrivals.drive, then the device's queue emptied."""
    from medha.benchmark.arrivals import drive

    done = drive(e, arrivals)
    sync(device)
    return done


def greedy(n: int):
    from medha.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def weight_bytes(e) -> int:
    return sum(p.numel() * p.element_size() for p in e.runner.model.parameters())


def kv_element_size(e) -> int:
    kv = e.runner.kv_caches[0]  # a layer's K and V: one tensor, or (before issue 49) a pair
    return (kv if hasattr(kv, "element_size") else kv[0]).element_size()


def bandwidth(device: str) -> float:
    """The device's memory bandwidth (bytes/s): a GPU's spec, this CPU as medha measures it."""
    if device == "cuda":
        import torch

        from medha.engine.setup import gpu_spec

        return gpu_spec(torch.cuda.get_device_name()).mem_bw
    from medha.perf.hardware_specs import this_cpu

    return this_cpu().mem_bw


def row_aten(a, s: Sizes, R: dict) -> None:
    """Top-level aten calls of one lone decode step (the runner's forward and logits), per
    layer: every call, and the calls that are no view (what launches work)."""
    from torch.profiler import ProfilerActivity, profile

    # one batch at a time and no graphs: the step the profiler sees is the eager forward (on
    # a CPU in float32, the reference path; bf16 there keeps transformers' order of ops)
    dtype = "float32" if a.device == "cpu" else a.dtype
    e = engine(a, kernels="torch", dtype=dtype, async_scheduling=False, cuda_graphs=False)
    e.add_request("a", ids(1, s.decode_ctx, e.runner.args.vocab_size), greedy(8))
    while e.scheduler.num_decoding == 0:
        e.step()
    batch = e.scheduler.schedule(time.monotonic())
    step, _ = e.runner.prepare(batch)
    e.runner.run(step)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        e.runner.run(step)
        sync(a.device)
    top = []
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            top.append(ev.name)
    views = {
        "aten::view", "aten::slice", "aten::t", "aten::transpose", "aten::unbind", "aten::chunk",
        "aten::split", "aten::split_with_sizes", "aten::unsqueeze", "aten::expand", "aten::reshape",
        "aten::select", "aten::as_strided", "aten::detach_", "aten::lift_fresh", "aten::alias",
        "aten::permute", "aten::squeeze", "aten::unflatten", "aten::narrow",
    }  # fmt: skip
    layers = len(e.runner.model.layers)
    counts: dict[str, int] = {}
    for name in top:
        counts[name] = counts.get(name, 0) + 1
    R["aten"] = {
        "layers": layers,
        "calls": len(top),
        "per_layer": len(top) / layers,
        "work_per_layer": sum(1 for n in top if n not in views) / layers,
        "by_op": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
    }
    print(
        f"aten: {len(top)} top-level calls a lone decode step, {R['aten']['per_layer']:.1f} a layer "
        f"({R['aten']['work_per_layer']:.1f} that are no view)",
        flush=True,
    )
    del e
    release()


def row_decode1(a, s: Sizes, R: dict, e) -> None:
    vocab = e.runner.args.vocab_size
    drain(e, [(0, "w", ids(0, 256, vocab), greedy(4))], a.device)
    m = drain(e, [(0, "d", ids(2, s.decode_ctx, vocab), greedy(s.decode_out))], a.device)["d"]
    bound = weight_bytes(e) / bandwidth(a.device)
    R["decode1"] = {
        "tpot_s": m["tpot_s"],
        "weights_read_s": bound,
        "over_bound": m["tpot_s"] / bound,
    }
    print(
        f"decode1: {m['tpot_s'] * 1e3:.2f} ms a token over {s.decode_ctx} tokens; reading the "
        f"weights once {bound * 1e3:.2f} ms ({m['tpot_s'] / bound:.2f}x)",
        flush=True,
    )


def row_decode64(a, s: Sizes, R: dict, e) -> None:
    vocab = e.runner.args.vocab_size
    reqs = [
        (0, f"b{i}", ids(100 + i, s.wide_prompt, vocab), greedy(s.wide_out)) for i in range(s.wide)
    ]
    t0 = time.monotonic()
    ms = drain(e, reqs, a.device)
    wall = time.monotonic() - t0
    tpots = [m["tpot_s"] for m in ms.values() if m["tpot_s"]]
    firsts = max(m["ttft_s"] for m in ms.values())
    cfg = e.runner.args
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_element_size(e)
    ctx = s.wide_prompt + s.wide_out // 2
    bound = (weight_bytes(e) + s.wide * ctx * kv_token) / bandwidth(a.device)
    tpot = statistics.median(tpots)
    # the rate of 64 decoding is the step's (64 / TPOT); the whole run's includes its prefills
    R["decode64"] = {
        "tpot_p50_s": tpot,
        "decode_tok_per_s": s.wide / tpot,
        "out_tok_per_s": s.wide * s.wide_out / wall,
        "wall_s": wall,
        "last_ttft_s": firsts,
        "bound_step_s": bound,
    }
    print(
        f"decode64: {s.wide} decoding, a step {tpot * 1e3:.2f} ms = {s.wide / tpot:.0f} tok/s "
        f"({s.wide * s.wide_out / wall:.0f} output tok/s over the whole run with its prefills); "
        f"the step's bound {bound * 1e3:.2f} ms",
        flush=True,
    )


def row_prefill(a, s: Sizes, R: dict, e) -> None:
    vocab = e.runner.args.vocab_size
    ttfts = [
        drain(e, [(0, f"p{i}", ids(10 + i, s.prefill, vocab), greedy(1))], a.device)[f"p{i}"][
            "ttft_s"
        ]
        for i in range(3)
    ]
    t = statistics.median(ttfts)
    cfg = e.runner.args
    n_params = sum(p.numel() for p in e.runner.model.parameters())
    flops = (
        2 * n_params * s.prefill
        + 2 * 2 * (s.prefill**2 / 2) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    )
    R["prefill"] = {"tokens": s.prefill, "ttft_s": t, "tflops": flops / t / 1e12}
    print(
        f"prefill: {s.prefill} tokens whole in {t * 1e3:.0f} ms, {flops / t / 1e12:.1f} TFLOP/s",
        flush=True,
    )


def convoy(a, s: Sizes, e, long_len: int) -> dict:
    """8 shorts alone, then the same behind a long prompt, then the long prompt alone."""
    vocab = e.runner.args.vocab_size
    drain(e, [(0, "w", ids(0, 512, vocab), greedy(4))], a.device)

    def shorts(seed):
        return [
            (0.1 * (i + 1), f"s{i}", ids(seed + i, s.short, vocab), greedy(s.short_out))
            for i in range(s.shorts)
        ]

    alone = drain(e, shorts(300), a.device)
    behind = drain(e, [(0.0, "long", ids(7, long_len, vocab), greedy(8))] + shorts(400), a.device)
    lone = drain(e, [(0.0, "L", ids(8, long_len, vocab), greedy(8))], a.device)["L"]["ttft_s"]
    a_p50 = statistics.median(alone[f"s{i}"]["ttft_s"] for i in range(s.shorts))
    b = [behind[f"s{i}"]["ttft_s"] for i in range(s.shorts)]
    return {
        "short_alone_p50_s": a_p50,
        "short_behind_p50_s": statistics.median(b),
        "short_behind_max_s": max(b),
        "short_tpot_behind_p50_s": statistics.median(
            behind[f"s{i}"]["tpot_s"] for i in range(s.shorts)
        ),
        "long_ttft_with_shorts_s": behind["long"]["ttft_s"],
        "long_ttft_alone_s": lone,
    }


def rows_long(a, s: Sizes, R: dict, which: set[str]) -> None:
    """The chunking and convoy rows: one whole-prompt engine and one with the default chunks."""
    whole = {}
    e = engine(a, "fcfs", "none")
    vocab = e.runner.args.vocab_size
    drain(e, [(0, "w", ids(0, 512, vocab), greedy(2))], a.device)
    for L in s.longs:
        whole[L] = statistics.median(
            drain(e, [(0, f"W{i}", ids(20 + i, L, vocab), greedy(2))], a.device)[f"W{i}"]["ttft_s"]
            for i in range(2)
        )
    del e
    release()
    e = engine(a, "lars", "adaptive")
    for L in s.longs:
        if "chunking" in which:
            drain(e, [(0, "w", ids(0, 512, vocab), greedy(2))], a.device)
            chunked = statistics.median(
                drain(e, [(0, f"C{i}", ids(20 + i, L, vocab), greedy(2))], a.device)[f"C{i}"][
                    "ttft_s"
                ]
                for i in range(2)
            )
            R.setdefault("chunking", {})[str(L)] = r = {
                "whole_s": whole[L],
                "chunked_s": chunked,
                "ratio": chunked / whole[L],
            }
            print(
                f"chunking: {L} tokens alone whole {whole[L]:.2f} s, in the default chunks {chunked:.2f} s ({r['ratio']:.3f}x)",
                flush=True,
            )
        if "convoy" in which:
            c = convoy(a, s, e, L)
            c["long_ttft_whole_s"] = whole[L]
            c["shorts_over_alone"] = c["short_behind_p50_s"] / c["short_alone_p50_s"]
            c["long_over_whole"] = c["long_ttft_with_shorts_s"] / whole[L]
            R.setdefault("convoy", {})[str(L)] = c
            print(
                f"convoy {L}: shorts alone {c['short_alone_p50_s'] * 1e3:.0f} ms, behind {c['short_behind_p50_s'] * 1e3:.0f} ms "
                f"({c['shorts_over_alone']:.2f}x, max {c['short_behind_max_s'] * 1e3:.0f} ms, TPOT {c['short_tpot_behind_p50_s'] * 1e3:.1f} ms); "
                f"long TTFT {c['long_ttft_with_shorts_s']:.2f} s with them = {c['long_over_whole']:.2f}x its whole time alone",
                flush=True,
            )
    del e
    release()


def row_hf(a, s: Sizes, R: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    from medha.engine.checkpoint import resolve_model

    m = (
        AutoModelForCausalLM.from_pretrained(resolve_model(a.model), dtype=dtype)
        .to(a.device)
        .eval()
    )
    vocab = m.config.vocab_size
    with torch.inference_mode():
        x = torch.tensor([ids(10, s.prefill, vocab)], device=a.device)
        m(x[:, :256])
        sync(a.device)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            m(x, logits_to_keep=1)
            sync(a.device)
            ts.append(time.perf_counter() - t0)
        y = torch.tensor([ids(2, s.decode_ctx, vocab)], device=a.device)
        n = s.decode_out
        t0 = time.perf_counter()
        m.generate(y, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        sync(a.device)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.generate(y, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(a.device)
        gen = time.perf_counter() - t0
    R["hf"] = {"prefill_s": statistics.median(ts), "tpot_s": (gen - first) / (n - 1)}
    print(
        f"transformers: {s.prefill}-token forward {statistics.median(ts) * 1e3:.0f} ms; generate "
        f"{(gen - first) / (n - 1) * 1e3:.2f} ms a token after {s.decode_ctx}",
        flush=True,
    )
    del m
    release()


def worker(a) -> dict:
    import torch

    a.device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    s = Sizes.for_device(a.device, a.quick)
    R: dict = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    rows = set(a.rows.split(","))

    def guard(name, fn):
        try:
            fn()
        except Exception as ex:  # one row's failure is a finding, not the end
            import traceback

            R.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            print(f"{name}: FAILED {ex!r}"[:800], flush=True)

    if "aten" in rows:
        guard("aten", lambda: row_aten(a, s, R))
    if rows & {"decode1", "decode64", "prefill"}:
        e = engine(a)
        R["engine"] = {
            "dtype": str(e.dtype),
            "kernels": e.kernels,
            "async": getattr(e, "async_scheduling", None),
        }
        for name, fn in (
            ("prefill", row_prefill),
            ("decode1", row_decode1),
            ("decode64", row_decode64),
        ):
            if name in rows:
                guard(name, lambda: fn(a, s, R, e))  # noqa: B023 (called at once)
        del e
        release()
    if rows & {"chunking", "convoy"}:
        guard("long", lambda: rows_long(a, s, R, rows))
    if "hf" in rows:
        guard("hf", lambda: row_hf(a, s, R))
    return R
