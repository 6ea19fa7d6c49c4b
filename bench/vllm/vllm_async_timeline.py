"""medha's scheduler on vLLM with async scheduling on and off: what a step costs, and when.

    python bench/vllm/vllm_async_timeline.py [--requests 256] [--new-tokens 64] [--model-ms 20]
        [--rounds 3] [--timeline 6]

vLLM turns async scheduling off on CPU (its CPU platform's config hook) and no GPU is needed to
see what it changes for the scheduler: this runs vLLM's own engine-core loop around
`MedhaScheduler` (tests/test_vllm_scheduler.py's model-free harness, with the machine's clock)
and stands a worker thread in for the model, which holds each step for `--model-ms` (a GPU step
of 256 decodes of an 8B model takes ~15-25 ms). Without async scheduling the loop is vLLM's
`EngineCore.step`: schedule, run, update. With it, it is `step_with_batch_queue`: step N+1 is
scheduled while the worker runs step N, and N's output is applied after that.

`--requests` requests of 16-64 prompt tokens arrive at once and decode `--new-tokens` tokens
each (fcfs with static chunks of 512, and lars with adaptive chunks). Reported for each mode,
over the steps while at least 90% of the requests run: medha's part of a step (what
MedhaScheduler's schedule() and update_from_output() spend outside the vLLM methods they call,
as bench/vllm/vllm_overhead.py counts it), p50 and p99; the share of schedule() calls that ran
while the model was busy; and the step period (from one update to the next: the model's time
plus what does not overlap it). `--timeline` prints that many steps of the async run as
intervals from the first one's start, which shows the overlap.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
sys.path.insert(0, str(HERE))

from medha.benchmark.harness import percentile  # noqa: E402

POLICIES = {
    "fcfs, static:512": {"policy": "fcfs", "chunking": "static:512"},
    "lars, adaptive": {"policy": "lars", "chunking": "adaptive"},
}


def run(model_dir: str, medha: dict, overlap: bool, args) -> dict:
    from test_vllm_scheduler import Harness
    from vllm_overhead import _ACCOUNT, _time_vllms_own_methods

    h = Harness(
        model_dir,
        medha,
        num_blocks=args.requests * 8 + 64,
        max_num_seqs=args.requests,
        async_scheduling=overlap,
    )
    sched = h.sched
    sched.clock = time.monotonic
    sched.medha.check_invariants = lambda: None  # (the harness's check, not the scheduler's)
    _time_vllms_own_methods()
    rng = random.Random(0)
    for i in range(args.requests):
        prompt = [rng.randrange(100, 900) for _ in range(rng.randrange(16, 65))]
        h.add(f"r{i}", prompt, max_tokens=args.new_tokens)
    worker = concurrent.futures.ThreadPoolExecutor(1)
    model_s = args.model_ms / 1e3
    events: list[tuple[str, int, float, float]] = []  # (what, step, start, end)
    steps: list[tuple[float, int, bool]] = []  # (medha's part, running, scheduled during model)
    own = {}  # step -> medha's part so far
    current = [0]  # the step being scheduled, or applied

    def timed(name: str, fn):
        def call(*a, **k):
            _ACCOUNT.clear()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            t1 = time.perf_counter()
            n = current[0]
            events.append((name, n, t0, t1))
            own[n] = own.get(n, 0.0) + t1 - t0 - _ACCOUNT.pop("vllm", 0.0)
            return out

        return call

    sched.schedule = timed("schedule", sched.schedule)
    sched.update_from_output = timed("update", sched.update_from_output)

    def model(step: int) -> None:
        t0 = time.perf_counter()
        time.sleep(model_s)
        events.append(("model", step, t0, time.perf_counter()))

    queue: list = []  # steps in flight, newest first: (step, future, output, runner, ...)

    step = 0
    while sched.requests or queue:
        if sched.has_requests():
            during = any(not future.done() for _, future, *_ in queue)  # the model is busy
            current[0] = step
            out, runner = h._schedule()
            queue.insert(0, (step, worker.submit(model, step), out, runner, during))
            step += 1
            if overlap and len(queue) < 2:
                continue
        elif not queue:
            break
        n, future, out, runner, during = queue.pop()
        future.result()
        current[0] = n
        h._update(out, runner)
        steps.append((own.pop(n, 0.0), len(sched.running), during))
    worker.shutdown()
    h.assert_nothing_left()
    most = max(running for _, running, _ in steps)
    full = [(own, during) for own, running, during in steps if running >= 0.9 * most]
    ends = sorted(end for what, _, _, end in events if what == "update")
    periods = [b - a for a, b in zip(ends, ends[1:])]
    return {"full": full, "most": most, "periods": periods, "events": events}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model-ms", type=float, default=20.0, help="the model's time per step")
    ap.add_argument("--rounds", type=int, default=3, help="sync and async alternated, per policy")
    ap.add_argument("--timeline", type=int, default=6, help="async steps to print (0: none)")
    ap.add_argument(
        "--modes",
        default="off,on",
        help="async scheduling off, on, or both (off,on; off alone runs where there is no "
        "async variant, for a before/after)",
    )
    ap.add_argument(
        "--calibrate",
        choices=("online", "off"),
        help="medha's setting (default: its own, online unless $MEDHA_CALIBRATE says otherwise)",
    )
    args = ap.parse_args()
    modes = [{"off": False, "on": True}[m] for m in args.modes.split(",")]
    from test_vllm_scheduler import write_config_only_model

    model_dir = write_config_only_model(Path(tempfile.mkdtemp(prefix="medha-config-only-")))
    results: dict = {}
    shown = None
    for name, medha in POLICIES.items():
        if args.calibrate:
            medha = {**medha, "calibrate": args.calibrate}
        for _ in range(args.rounds):
            for overlap in modes:
                r = run(model_dir, medha, overlap, args)
                results.setdefault((name, overlap), []).append(r)
                if overlap and shown is None:
                    shown = r
    print(
        f"\n{args.requests} requests decoding together, {args.new_tokens} tokens each, "
        f"a model step of {args.model_ms:g} ms, {args.rounds} rounds, "
        f"calibrate {args.calibrate or 'default'}\n"
    )
    print(
        "| medha | async scheduling | most running | steps timed | medha's part p50 | p99 "
        "| schedule() during the model step | step period p50 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (name, overlap), runs in results.items():
        own = [o for r in runs for o, _ in r["full"]]
        during = [d for r in runs for _, d in r["full"]]
        periods = [p for r in runs for p in r["periods"]]
        # a measured value, the one at floor(0.99 n) of the sorted list: numpy's "higher"
        p99 = percentile(own, 99, method="higher")
        print(
            f"| {name} | {'on' if overlap else 'off'} | {runs[0]['most']} | {len(own)} | "
            f"{statistics.median(own) * 1e6:.0f} us | {p99 * 1e6:.0f} us | "
            f"{sum(during) / len(during):.0%} | {statistics.median(periods) * 1e3:.2f} ms |"
        )
    if args.timeline and shown is not None:
        events = shown["events"]
        middle = len(events) // 2
        window = sorted(events[middle : middle + 3 * args.timeline], key=lambda e: e[2])
        t0 = window[0][2]
        print(f"\nasync scheduling, {args.timeline * 3} events mid-run (ms from the first):\n")
        for what, n, start, end in window:
            print(f"  step {n:4d} {what:8s} {(start - t0) * 1e3:8.2f} -> {(end - t0) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
