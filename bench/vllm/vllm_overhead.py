"""Scheduling time per step on vLLM's engine: vLLM's own scheduler against medha's.

    python bench/vllm/vllm_overhead.py [--requests 256] [--new-tokens 64]

SmolLM2-135M (fp32, vLLM's offline engine in this process). `--requests` requests of 16-64
prompt tokens are submitted at once and decoded together; every step's `schedule()` and
`update_from_output()` are timed (the scheduler's whole share of a step; the forward pass is
not in it), and so is medha's own part of it under MedhaScheduler (all it does outside the
vLLM methods it calls: its ReplicaScheduler's schedule and update, putting the batch first in
vLLM's queues, reconciling vLLM's output with the plan). Reported: p50 and
p99 over the steps while at least 90% of the requests are running (of the most that ran at
once), for plain vLLM and for vLLM + medha (fcfs and lars). `--trace`: for each medha
contender, its largest steps part by part (the replica scheduler's schedule and update, within
the update the learner's fit and a slice of a re-resolution of the defaults, the repricing, and
Python's garbage collections that fell inside medha's code).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _wrap(owner, name: str, account: dict, key: str) -> None:
    """Add the time of each call of owner.name (an instance attribute from now on) to
    account[key]."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            account[key] = account.get(key, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed)


_ACCOUNT: dict = {}  # seconds spent this step, by part


def _time_vllms_own_methods() -> None:
    """Time vLLM's Scheduler.schedule and update_from_output themselves (once per process):
    under MedhaScheduler, the super() calls."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_medha_bench_timed", False):
        return
    Scheduler._medha_bench_timed = True
    for name in ("schedule", "update_from_output"):
        vllm_own = getattr(Scheduler, name)

        @functools.wraps(vllm_own)  # (its signature: MedhaScheduler checks it)
        def inner(self, *args, _fn=vllm_own, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                _ACCOUNT["vllm"] = _ACCOUNT.get("vllm", 0.0) + time.perf_counter() - t0

        setattr(Scheduler, name, inner)


def timed(scheduler, samples: list) -> None:
    """One (scheduler seconds, medha's seconds, running requests) per step. medha's part is
    everything MedhaScheduler's schedule() and update_from_output() do outside the vLLM
    Scheduler methods they call (super()): its ReplicaScheduler, putting the batch first in
    vLLM's queues, reconciling."""
    _time_vllms_own_methods()
    account = _ACCOUNT
    _wrap(scheduler, "schedule", account, "all")
    update = scheduler.update_from_output

    def timed_update(*args, **kwargs):
        t0 = time.perf_counter()
        out = update(*args, **kwargs)
        total = account.pop("all", 0.0) + time.perf_counter() - t0
        medha = total - account.pop("vllm", 0.0)
        samples.append((total, medha, len(scheduler.running), dict(account)))
        account.clear()
        return out

    scheduler.update_from_output = timed_update


# medha's parts timed by --trace: (owner's path from the replica scheduler, method)
TRACED = (
    ("", "schedule"),
    ("", "update"),
    ("learner", "observe"),
    ("recalibration", "follow"),
    ("requests", "reprice"),
)


def trace(scheduler) -> Callable:
    """Time medha's parts (TRACED) and the garbage collections inside the replica scheduler's
    schedule and update (by generation) into each step's account; the garbage collector's
    callback it added (the caller removes it)."""
    sched = scheduler.medha
    for path, name in TRACED:
        owner = getattr(sched, path) if path else sched
        if owner is not None:
            _wrap(owner, name, _ACCOUNT, f"{path}.{name}".lstrip("."))
    inside, started = [0], []
    for name in ("schedule", "update"):
        fn = getattr(sched, name)

        def counted(*args, _fn=fn, **kwargs):
            inside[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                inside[0] -= 1

        setattr(sched, name, counted)

    def collected(phase, info) -> None:
        if not inside[0]:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            key = f"gc (generation {info['generation']})"
            _ACCOUNT[key] = _ACCOUNT.get(key, 0.0) + time.perf_counter() - started.pop()

    gc.callbacks.append(collected)
    return collected


def run(path: str, medha: dict | None, args) -> tuple[list[tuple[float, float]], int]:
    import vllm

    kwargs = dict(model=path, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True)
    kwargs.update(kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)))
    kwargs.update(max_num_seqs=args.requests, max_num_batched_tokens=max(2048, args.requests * 64))
    if medha is not None:
        kwargs.update(
            scheduler_cls="medha.vllm_executor.MedhaScheduler", additional_config={"medha": medha}
        )
    llm = vllm.LLM(**kwargs)
    samples: list = []
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    timed(scheduler, samples)
    traced = trace(scheduler) if args.trace and medha is not None else None
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 65))]}
        for _ in range(args.requests)
    ]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    if traced is not None:
        gc.callbacks.remove(traced)
    most = max(running for _, _, running, _ in samples)
    full = [(s, own, parts) for s, own, running, parts in samples if running >= 0.9 * most]
    preemptions = scheduler.medha.stats.preemptions if medha is not None else None
    del llm
    return full, most, preemptions


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--kv-gib",
        type=float,
        default=4.0,
        help="vLLM's KV cache (default 4 GiB: room for every request at once, so the steps "
        "timed are those of 256 running requests, not of preemptions; 2 GiB preempts ~75)",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="for each medha contender, its largest steps part by part (learner's fit, "
        "re-resolution slice, repricing, garbage collections)",
    )
    args = ap.parse_args()
    from medha.engine.checkpoint import resolve_model

    path = str(resolve_model("smollm2"))
    contenders = {
        "vLLM": None,
        "vLLM + medha (fcfs, static:512)": {"policy": "fcfs", "chunking": "static:512"},
        "vLLM + medha (lars, adaptive)": {"policy": "lars", "chunking": "adaptive"},
    }
    results = {name: run(path, medha, args) for name, medha in contenders.items()}
    print(f"\n{args.requests} requests decoding together, {args.new_tokens} tokens each\n")
    print(
        "| scheduler | most running | medha's preemptions | steps | schedule + update p50 | p99 "
        "| medha's part p50 | p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (steps, most, preemptions) in results.items():
        cells = [str(most), "" if preemptions is None else str(preemptions), str(len(steps))]
        parts = [[s for s, _, _ in steps]]
        parts += [] if preemptions is None else [[o for _, o, _ in steps]]
        for times in parts:
            times.sort()
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            cells += [f"{statistics.median(times) * 1e3:.3f} ms", f"{p99 * 1e3:.3f} ms"]
        print(f"| {name} | " + " | ".join(cells + [""] * (8 - 1 - len(cells))) + " |")
    if args.trace:
        for name, (steps, _, preemptions) in results.items():
            if preemptions is None:
                continue
            print(f"\n{name}: the 5 largest steps of medha's part, by part (ms)")
            for _, own, account in sorted(steps, key=lambda step: -step[1])[:5]:
                shown = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(account.items()))
                print(f"  {own * 1e3:.3f}: {shown}")


if __name__ == "__main__":
    main()
