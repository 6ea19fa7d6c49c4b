"""medha/benchmark/harness.py: the flags every bench shares, its percentiles, its tables."""

import argparse
from pathlib import Path

import numpy as np
import pytest

from medha.benchmark.harness import (
    add_common_args,
    dominates,
    markdown_table,
    pareto_front,
    percentile,
)


def test_only_the_named_flags_are_added_with_their_defaults():
    ap = add_common_args(argparse.ArgumentParser(), seed=3, num_requests=50)
    args = ap.parse_args([])
    assert (args.seed, args.num_requests) == (3, 50)
    assert not hasattr(args, "out")
    with pytest.raises(SystemExit):
        ap.parse_args(["--out", "x"])


def test_out_is_required_where_the_bench_needs_it():
    ap = add_common_args(argparse.ArgumentParser(), out=...)
    with pytest.raises(SystemExit):
        ap.parse_args([])
    assert ap.parse_args(["--out", "d"]).out == "d"
    assert add_common_args(argparse.ArgumentParser(), out="runs/x").parse_args([]).out == "runs/x"


def test_out_takes_the_type_the_bench_writes_through():
    ap = add_common_args(argparse.ArgumentParser(), out=None, out_type=Path)
    assert ap.parse_args(["--out", "r/x.json"]).out == Path("r/x.json")
    assert ap.parse_args([]).out is None
    plain = add_common_args(argparse.ArgumentParser(), out=None)
    assert plain.parse_args(["--out", "x"]).out == "x"


def test_percentiles_skip_missing_values_and_follow_numpy():
    vals = [4.0, None, 1.0, 3.0, 2.0]
    assert percentile(vals, 50) == 2.5
    assert percentile(vals, 50, method="lower") == 2.0
    assert percentile([None], 99) is None
    rng = np.random.default_rng(0)
    xs = list(rng.random(101))
    assert percentile(xs, 99.9) == float(np.percentile(xs, 99.9))


def test_a_markdown_table_is_its_header_rule_and_rows():
    text = markdown_table(["name", "p99"], [["a", 1.5], ["b", None]])
    assert text.splitlines() == ["| name | p99 |", "|---|---|", "| a | 1.5 |", "| b | None |"]


def test_the_pareto_front_keeps_what_nothing_beats_on_every_measure():
    assert dominates((1.0, 2.0), (1.0, 3.0)) and not dominates((1.0, 3.0), (1.0, 3.0))
    assert not dominates((0.5, 4.0), (1.0, 3.0))  # better on one, worse on the other
    points = {
        "vLLM": (1.00, 13.5),
        "threshold 256": (1.15, 2.3),
        "threshold 512": (1.25, 3.0),  # beaten on both by 256
        "medha": (1.29, 1.1),
        "tie": (1.29, 1.1),  # equal points beat neither
    }
    assert pareto_front(points) == ["vLLM", "threshold 256", "medha", "tie"]
