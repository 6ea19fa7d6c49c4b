"""What every script in bench/ shares: the flags they all name the same way, percentiles, and
a Markdown table's text.

A bench adds the shared flags it takes with `add_common_args`, so that `--seed`, `--out` and
`--num-requests` mean one thing, with one help text, in every bench; its own flags stay its own.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

_UNSET = object()


def add_common_args(
    ap: argparse.ArgumentParser,
    *,
    seed: object = _UNSET,
    out: object = _UNSET,
    num_requests: object = _UNSET,
    out_help: str | None = None,
    num_requests_help: str | None = None,
    out_type: Callable[[str], object] | None = None,
) -> argparse.ArgumentParser:
    """Add the shared flags a bench takes, each with its default: only those named are added
    (a bench with no workload to seed takes no --seed). `out=None` makes --out optional with
    no default; `out=...` (the Ellipsis) makes it required; `out_type` converts what is given
    (Path, where the bench writes through it), a string otherwise."""
    if seed is not _UNSET:
        ap.add_argument(
            "--seed",
            type=int,
            default=seed,
            help="seed of the workload's random draws (default %(default)s)",
        )
    if out is not _UNSET:
        required = out is ...
        ap.add_argument(
            "--out",
            **({"type": out_type} if out_type is not None else {}),
            required=required,
            default=None if required else out,
            help=(out_help or "where the results go")
            + ("" if required or out is None else " (default %(default)s)"),
        )
    if num_requests is not _UNSET:
        ap.add_argument(
            "--num-requests",
            type=int,
            default=num_requests,
            help=(num_requests_help or "requests in the workload") + " (default %(default)s)",
        )
    return ap


def percentile(values: Iterable[float | None], q: float, method: str = "linear") -> float | None:
    """The q-th percentile (0-100) of the values that are not None, None when there are none.
    `method` is numpy's (linear interpolation by default; "lower", "higher", "nearest" or
    "inverted_cdf" where a bench reports a value that was measured)."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return None
    return float(np.percentile(a, q, method=method))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: the header, its rule, a line a row (cells as str() gives them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether `a` is at or below `b` on every measure (lower is better) and not equal to it."""
    return all(x <= y for x, y in zip(a, b, strict=True)) and tuple(a) != tuple(b)


def pareto_front(points: dict[str, Sequence[float]]) -> list[str]:
    """The names whose point no other point dominates (lower is better on every measure), in
    `points`' order: the settings of a sweep worth a user's choice."""
    return [n for n, p in points.items() if not any(dominates(q, p) for q in points.values())]


def parse_slo(spec: str) -> tuple[float, float, float]:
    """'ttft=A[+B*prompt],tpot=C' -> (A, B, C): a request meets it when its TTFT <= A + B x its
    prompt's tokens and its TPOT <= C (seconds)."""
    items = dict(item.split("=", 1) for item in spec.replace(" ", "").split(",") if "=" in item)
    if set(items) != {"ttft", "tpot"}:
        raise argparse.ArgumentTypeError(f"--slo {spec!r}: expected 'ttft=A[+B*prompt],tpot=C'")
    base, _, scaled = items["ttft"].partition("+")
    if scaled and not scaled.endswith("*prompt"):
        raise argparse.ArgumentTypeError(f"--slo {spec!r}: the TTFT's second term is B*prompt")
    try:
        per_token = float(scaled.removesuffix("*prompt")) if scaled else 0.0
        slo = (float(base), per_token, float(items["tpot"]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slo {spec!r}: not numbers") from None
    if not (slo[0] > 0 and slo[1] >= 0 and slo[2] > 0):
        raise argparse.ArgumentTypeError(f"--slo {spec!r}: targets must be positive")
    return slo


def goodput(run: Path, slo: tuple[float, float, float], wall_s: float) -> float:
    """Goodput as `vllm bench serve --goodput` counts it: the requests of a `medha bench` run
    (its folder's requests.csv) that completed within both targets, per second of the run's
    duration `wall_s`. A request of one token has no TPOT and is judged on its TTFT."""
    good = 0
    with (run / "requests.csv").open() as fh:
        for row in csv.DictReader(fh):
            if row["status"] != "ok" or not row["ttft_s"]:
                continue
            ttft_target = slo[0] + slo[1] * int(row["num_prefill_tokens"])
            tpot = float(row["tpot_s"]) if row["tpot_s"] not in ("", "None") else 0.0
            good += float(row["ttft_s"]) <= ttft_target and tpot <= slo[2]
    return good / wall_s
