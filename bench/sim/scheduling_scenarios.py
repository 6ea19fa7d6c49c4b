"""The paper's illustrative example and a starvation stream, under every policy.

    python bench/sim/scheduling_scenarios.py

The setups of medha/benchmark/scenarios.py, which tests/test_scenarios.py checks; prints
markdown tables of TTFT per request class.
"""

from __future__ import annotations

from medha.benchmark.harness import percentile
from medha.benchmark.scenarios import illustrative, steady_stream

POLICIES = ["fcfs", "edf", "lrs", "lars", "srpt"]


def main() -> None:
    print("Illustrative example: r_L (10 s of work, deadline 16 s) at t=0, r_S1 and r_S2")
    print("(0.5 s each, deadline 1 s) at t=5; fixed-cost toy predictor, 125 ms iterations.\n")
    print("| policy | chunking | space sharing | TTFT r_L | TTFT r_S1 | TTFT r_S2 | all met |")
    print("|---|---|---|---|---|---|---|")
    deadlines = {"r_L": 16.0, "r_S1": 1.0, "r_S2": 1.0}
    cases = [("fcfs", "none", False)] + [
        (p, "adaptive", ss) for p in POLICIES for ss in (False, True)
    ]
    for policy, chunking, ss in cases:
        t = illustrative(policy, chunking, space_sharing=ss)
        met = all(t[k] <= deadlines[k] for k in t)
        print(
            f"| {policy} | {chunking} | {'on' if ss else 'off'} | {t['r_L']:.3f} s | "
            f"{t['r_S1']:.3f} s | {t['r_S2']:.3f} s | {'yes' if met else 'no'} |"
        )

    print("\nStarvation stream: a 500K-token prompt at t=0, then a 1500-token request (100")
    print("output tokens) every 32 ms for 50 s; Llama-3-8B, 8xH100 TP8, 50 ms budget.\n")
    print("| policy | long TTFT / deadline | shorts meeting TTFT | short TTFT p50 | p99 | max |")
    print("|---|---|---|---|---|---|")
    import numpy as np

    for policy in POLICIES:
        long_, shorts = steady_stream(policy)
        ttft = [r.ttft_s for r in shorts]
        met = np.mean([r.ttft_s <= r.deadline_s - r.arrival_s for r in shorts])
        print(
            f"| {policy} | {long_.ttft_s:.2f} / {long_.deadline_s:.2f} s | {met:.1%} | "
            f"{percentile(ttft, 50):.3f} s | {percentile(ttft, 99):.3f} s | "
            f"{max(ttft):.3f} s |"
        )


if __name__ == "__main__":
    main()
