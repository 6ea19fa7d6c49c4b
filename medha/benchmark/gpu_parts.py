"""The parts of medha's engine on a CUDA GPU, measured and checked for bench/gpu/engine_gpu_parts.py:
the decode attention kernels against exact attention and the torch path, the prefix merge's
kernels against the masked SDPA, a small random Llama decoding by each kernel (tokens compared),
and a decode step broken down into its parts. `DEV` is the device ("cpu": a dry run at tiny
sizes), `R` what was found, written out by the script.

The script loads this file by its path and imports medha only once its --project is on the
path: so this module imports medha only inside its functions.
"""

# ruff: noqa: E501, B023, E731  (a measuring script: timed closures are called at once)
from __future__ import annotations

import json
import os
import random
import time

import torch

R: dict = {}
DEV = "cuda"


def timeit(fn, n=20, warm=3):
    if DEV == "cpu":  # the dry run
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n / 1e3


def guard(name, fn):
    try:
        fn()
    except Exception as ex:  # noqa: BLE001
        import traceback

        R.setdefault("errors", {})[name] = traceback.format_exc()[-1500:]
        print(f"{name}: FAILED {ex!r}"[:800], flush=True)


def decode_kernel_checks():
    # (Triton's interpreter mishandles bf16 products: the dry run checks fp32 only)
    for dtype in (torch.float32, torch.bfloat16) if DEV == "cuda" else (torch.float32,):
        cases = (
            ("mixed", [1, 17, 300, 1024]),
            ("64x640", [640] * 64),
            ("1x1024", [1024]),
            ("1x32768", [32768]),
            ("1x131072", [131072]),
            ("8x8192", [8192] * 8),
        )
        if DEV == "cpu":
            cases = (("mixed", [1, 17, 70]), ("3x64", [64] * 3))
        for desc, lens in cases:
            _decode_case(dtype, desc, lens)


def _decode_case(dtype, desc: str, lens: list[int]) -> None:
    """One mix of contexts: the Triton kernel's error against exact attention, its time and
    KV bandwidth, and the torch path's time."""
    from medha.engine.layers.attention import (
        DecodeGroup,
        Workspace,
        _decode_attention,
        _lone_decode_attention,
    )
    from medha.engine.layers.triton_decode import paged_decode, splits_for

    kvh, heads, d, bs = 8, 32, 128, 16
    scale = d**-0.5
    nb = sum(-(-L // bs) for L in lens) + 2
    k = torch.randn(kvh, nb * bs, d, device=DEV, dtype=dtype)
    v = torch.randn(kvh, nb * bs, d, device=DEV, dtype=dtype)
    perm = torch.randperm(nb).tolist()
    tables, i = [], 0
    for L in lens:
        c = -(-L // bs)
        tables.append(perm[i : i + c])
        i += c
    W = max(len(t) for t in tables)
    tab = torch.tensor([t + [0] * (W - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    ln = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), heads, d, device=DEV, dtype=dtype)
    splits = splits_for(len(lens), kvh, torch.device(DEV))
    if DEV == "cpu":
        splits = 3
    out = paged_decode(q, k, v, tab, ln, bs, scale, splits)
    err = 0.0
    for r, L in enumerate(lens[:4]):
        t = torch.tensor(tables[r], device=DEV)
        pos = torch.arange(L, device=DEV)
        slots = t[pos // bs] * bs + pos % bs
        kk, vv = k[:, slots].float(), v[:, slots].float()
        qg = q[r].float().view(kvh, heads // kvh, d)
        ref = torch.softmax(qg @ kk.transpose(-1, -2) * scale, -1) @ vv
        err = max(err, (ref.reshape(heads, d) - out[r].float()).abs().max().item())
    t_new = timeit(lambda: paged_decode(q, k, v, tab, ln, bs, scale, splits))
    # the torch path as the runner builds it
    if len(lens) == 1:
        pos = torch.arange(lens[0])
        slots = (torch.tensor(tables[0])[pos // bs] * bs + pos % bs).to(DEV)
        kv = torch.cat([k, v])  # the runner's cache: K heads, then V heads
        old = lambda: _lone_decode_attention(q, kv, slots, scale)
    else:
        lens_t = torch.tensor(lens)
        table = torch.tensor([t + [0] * (W - len(t)) for t in tables], dtype=torch.long)
        mask = (torch.arange(W * bs)[None, :] < lens_t[:, None])[None, :, None, :]
        g = DecodeGroup(0, len(lens), table.reshape(-1).to(DEV), mask.to(DEV))
        ws = Workspace()
        old = lambda: _decode_attention(q, k, v, g, bs, ws, scale)
    t_old = timeit(old, n=10)
    kv_bytes = 2 * sum(lens) * kvh * d * k.element_size()
    key = f"{str(dtype)[6:]}/{desc}"
    R.setdefault("decode_kernel", {})[key] = r = {
        "splits": splits,
        "max_abs_err": err,
        "triton_ms": t_new * 1e3,
        "torch_path_ms": t_old * 1e3,
        "triton_GBps": kv_bytes / t_new / 1e9,
    }
    print(
        f"decode {key}: err {err:.2e}, triton {r['triton_ms']:.3f} ms ({r['triton_GBps']:.0f} GB/s KV), "
        f"torch path {r['torch_path_ms']:.3f} ms, splits {splits}",
        flush=True,
    )
    if DEV == "cuda":
        torch.cuda.empty_cache()


def prefix_checks():
    kvh, heads, d, n = 8, 32, 128, 2048 if DEV == "cuda" else 32
    scale = d**-0.5

    for P in (2048, 30720, 120832) if DEV == "cuda" else (64,):
        _prefix_case(P, n, kvh, heads, d, scale)


def _prefix_case(P: int, n: int, kvh: int, heads: int, d: int, scale: float) -> None:
    """An n-token chunk over a P-token prefix by each kernel: error against the masked SDPA,
    time, TFLOP/s, against its share of the whole prompt's causal attention."""
    import torch.nn.functional as F

    from medha.engine.layers.attention import (
        PrefillSpan,
        _cudnn_with_lse,
        _flash_for,
        _lower_right_causal,
        _prefix_attention,
    )

    ctx = P + n
    kc = torch.randn(kvh, ctx, d, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn(kvh, ctx, d, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(n, heads, d, device=DEV, dtype=torch.bfloat16)
    k, v = kc[:, P:].transpose(0, 1), vc[:, P:].transpose(0, 1)
    span = PrefillSpan(0, n, P, torch.arange(ctx, device=DEV))
    flash = _flash_for(q)

    def old():
        qp = q.transpose(0, 1).unsqueeze(0).contiguous()
        kp = kc.index_select(1, span.context_slots).unsqueeze(0)
        vp = vc.index_select(1, span.context_slots).unsqueeze(0)
        mask = _lower_right_causal(n, ctx, q.device)
        return (
            F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
            .squeeze(0)
            .transpose(0, 1)
        )

    new = lambda: _prefix_attention(q, k, v, kc, vc, span, scale, flash)
    cud = lambda: _prefix_attention(q, k, v, kc, vc, span, scale, _cudnn_with_lse)

    def whole():
        qq = torch.randn(1, heads, ctx, d, device=DEV, dtype=torch.bfloat16)
        return lambda: F.scaled_dot_product_attention(
            qq, kc.unsqueeze(0), vc.unsqueeze(0), is_causal=True, enable_gqa=True
        )

    def lower_right():
        from torch.nn.attention.bias import causal_lower_right

        qp = q.transpose(0, 1).unsqueeze(0).contiguous()
        bias = causal_lower_right(n, ctx)
        return lambda: F.scaled_dot_product_attention(
            qp, kc.unsqueeze(0), vc.unsqueeze(0), attn_mask=bias, scale=scale, enable_gqa=True
        )

    ref = old().float()
    row = {}
    for name, fn in (("masked_sdpa", old), ("flash_merge", new), ("cudnn_merge", cud)):
        try:
            row[name + "_err"] = (fn().float() - ref).abs().max().item()
            row[name + "_ms"] = timeit(fn, n=5, warm=1) * 1e3
        except Exception as ex:  # noqa: BLE001
            row[name] = repr(ex)[:300]
    for name, mk in (("lower_right_bias", lower_right), ("whole_causal", whole)):
        try:
            row[name + "_ms"] = timeit(mk(), n=5, warm=1) * 1e3
        except Exception as ex:  # noqa: BLE001
            row[name] = repr(ex)[:300]
    flops = 4 * n * (P + n / 2) * d * heads
    if "whole_causal_ms" in row:
        whole_flops = 4 * ctx * ctx / 2 * d * heads
        row["whole_TFLOPs"] = whole_flops / row["whole_causal_ms"] * 1e-9
        row["chunk_share_of_whole_ms"] = row["whole_causal_ms"] * flops / whole_flops
    for name in ("masked_sdpa", "flash_merge", "cudnn_merge", "lower_right_bias"):
        if name + "_ms" in row:
            row[name + "_TFLOPs"] = flops / row[name + "_ms"] * 1e-9
    R.setdefault("prefix_attention", {})[f"2048@{P}"] = row
    print(
        f"prefix 2048 over {P}: "
        + ", ".join(f"{a} {b:.3g}" for a, b in row.items() if isinstance(b, float)),
        flush=True,
    )
    if DEV == "cuda":
        torch.cuda.empty_cache()


def small_model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = "/tmp/small-llama"
    cfg = json.load(open(os.path.join(tok, "config.json")))
    c = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        initializer_range=0.08,
        rms_norm_eps=1e-5,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(c).save_pretrained(path, safe_serialization=True)
    for f in os.listdir(tok):
        if f != "config.json":
            with open(os.path.join(tok, f), "rb") as a, open(os.path.join(path, f), "wb") as b:
                b.write(a.read())
    return path


def engine_checks(tok):
    from medha.engine.llm import LLM
    from medha.engine.sampling_params import SamplingParams
    from medha.scheduler.config import SchedulerConfig

    path = small_model(tok)
    R["small_model"] = path
    rng = random.Random(0)
    lengths = (5, 17, 40, 90, 150, 260, 400, 700) if DEV == "cuda" else (5, 40)
    prompts = [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]
    new = 24 if DEV == "cuda" else 3
    for dtype in ("float32", "bfloat16") if DEV == "cuda" else ("float32",):
        toks = {}
        for variant, env, graphs in (
            ("torch", "torch", False),
            ("triton", "triton", False),
            ("graphs", "auto", True),
        ):
            os.environ["MEDHA_DECODE_KERNEL"] = env
            for pol, ch in (("fcfs", "static:16"), ("lars", "adaptive")):
                llm = LLM(
                    path,
                    SchedulerConfig(policy=pol, chunking=ch, prefix_cache="off"),
                    device=DEV,
                    dtype=dtype,
                    kv_memory_gb=2 if DEV == "cuda" else 0.05,
                    cuda_graphs=graphs,
                    kernels="torch",
                )
                outs = llm.generate(
                    prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
                )
                toks[(variant, pol)] = [o.token_ids for o in outs]
                g = llm.engine.runner.graphs
                if pol == "fcfs":
                    p = SamplingParams(
                        max_tokens=129 if DEV == "cuda" else 3, temperature=0, ignore_eos=True
                    )
                    llm.generate([prompts[-1]], p)
                    t0 = time.perf_counter()
                    llm.generate([prompts[-1]], p)
                    tpot = (time.perf_counter() - t0) / 129
                    R.setdefault("small_tpot_ms", {})[f"{dtype}/{variant}"] = tpot * 1e3
                    print(
                        f"small {dtype} {variant}: ~{tpot * 1e3:.2f} ms/token (lone decode incl. prefill), graph replays {g and g.replays}",
                        flush=True,
                    )
                del llm
                if DEV == "cuda":
                    torch.cuda.empty_cache()
        for pol in ("fcfs", "lars"):
            base = toks[("torch", pol)]
            for variant in ("triton", "graphs"):
                other = toks[(variant, pol)]
                same = sum(a == b for a, b in zip(base, other))
                firsts = [
                    next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                    for a, b in zip(base, other)
                ]
                R.setdefault("small_tokens", {})[f"{dtype}/{pol}/{variant}"] = {
                    "same": same,
                    "of": len(base),
                    "first_diff": firsts,
                }
                print(
                    f"small {dtype} {pol} {variant} vs torch path: {same}/{len(base)} token-exact, first diffs {firsts}",
                    flush=True,
                )
    os.environ.pop("MEDHA_DECODE_KERNEL", None)


def step_breakdown(ckpt):
    from medha.engine.config import EngineConfig
    from medha.engine.llm_engine import LLMEngine
    from medha.engine.sampling_params import SamplingParams
    from medha.scheduler.config import SchedulerConfig

    # graphs with async scheduling (CUDA's default), graphs one batch at a time, eager
    for graphs, ahead in ((True, True), (True, False), (False, False)):
        e = LLMEngine(
            EngineConfig(
                model=ckpt,
                device=DEV,
                dtype="bfloat16" if DEV == "cuda" else "float32",
                kv_memory_gb=24 if DEV == "cuda" else 0.05,
                cuda_graphs=graphs,
                async_scheduling=ahead,
                kernels="torch",
            ),
            SchedulerConfig(policy="fcfs", chunking="none", prefix_cache="off"),
        )
        T = _time_parts(e)
        rng = random.Random(5)
        for width in (1, 64) if DEV == "cuda" else (1, 3):
            for i in range(width):
                e.add_request(
                    f"w{width}-{i}",
                    [rng.randrange(3, 49000) for _ in range(512)],
                    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                )
            e.step()  # the prefills
            for _ in range(5):
                e.step()
            T.clear()
            n, t0 = 0, time.perf_counter()
            for _ in range(20 if DEV == "cuda" else 2):
                e.step()
                n += 1
            if DEV == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / n
            key = f"{'graphs' if graphs else 'eager'}{'+async' if ahead else ''}/{width}"
            R.setdefault("step_breakdown_ms", {})[key] = {
                "wall": wall * 1e3,
                **{k: v / n * 1e3 for k, v in T.items()},
            }
            print(
                f"8B decode step {key}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in R["step_breakdown_ms"][key].items()),
                flush=True,
            )
            if graphs and ahead and width == (64 if DEV == "cuda" else 3):
                _profile_graphs(e)
            if not graphs and width == 1:
                _profile_eager(e)
            while e.has_unfinished():
                e.step()
        del e
        if DEV == "cuda":
            torch.cuda.empty_cache()


def _time_parts(e) -> dict:
    """Wrap the engine's schedule, update, run and prepare to sum their time in the dict
    returned (cleared by the caller)."""
    T = {}
    for obj, name in (
        (e.scheduler, "schedule"),
        (e.scheduler, "update"),
        (e.runner, "run"),
        (e.runner, "prepare"),
    ):
        f = getattr(obj, name)

        def w(*a, _f=f, _n=name, **k):
            t = time.perf_counter()
            x = _f(*a, **k)
            T[_n] = T.get(_n, 0.0) + time.perf_counter() - t
            return x

        setattr(obj, name, w)
    return T


def _profile_graphs(e) -> None:
    """A Python profile of ten steps (the widest batch, graphs and async scheduling)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        e.step()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    R["cprofile_graphs_64"] = buf.getvalue()
    print(buf.getvalue()[-5000:], flush=True)


def _profile_eager(e) -> None:
    """The kernels of three eager lone decode steps, by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            e.step()
        if DEV == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)
    R["eager_lone_decode_profile"] = table
    print(table[-3000:], flush=True)
