"""Predictor error on measured A100 op timings held out of the fit.

    python bench/sim/predictor_accuracy.py [--model llama-3-8b] [--test-fraction 0.2] [--seed 0]

For each (op, TP degree) group of the Vidur profile, a random 20% of rows is held out; the
fitted model is trained on the rest. The analytic (roofline) model is evaluated on the same
held-out rows. Prints a markdown table of |relative error| per op.
"""

from __future__ import annotations

import argparse

from medha.benchmark.harness import add_common_args
from medha.perf import get_hardware, get_model
from medha.perf.accuracy import op_holdout_errors, summarize
from medha.perf.profile_data import PROFILE_DIR, load_profile

FILES = {
    "llama-3-8b": "a100_Meta-Llama-3-8B_mlp.csv",
    "llama-3-70b": "a100_Meta-Llama-3-70B_mlp.csv",
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama-3-8b", choices=sorted(FILES))
    ap.add_argument("--test-fraction", type=float, default=0.2)
    add_common_args(ap, seed=0)
    args = ap.parse_args()
    profile = load_profile(PROFILE_DIR / FILES[args.model])
    table = summarize(
        op_holdout_errors(
            profile, get_model(args.model), get_hardware("a100"), args.test_fraction, args.seed
        )
    )
    print(f"A100 {args.model}, {args.test_fraction:.0%} of rows held out (seed {args.seed})\n")
    print("| op | held-out rows | fitted median | fitted P95 | analytic median | analytic P95 |")
    print("|---|---|---|---|---|---|")
    for op, s in table.items():
        print(
            f"| {op} | {s['rows']} | {s['fitted_median']:.1%} | {s['fitted_p95']:.1%} | "
            f"{s['analytic_median']:.1%} | {s['analytic_p95']:.1%} |"
        )


if __name__ == "__main__":
    main()
