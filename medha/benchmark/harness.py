"""What every script in bench/ shares: the flags they all name the same way, percentiles, and
one writer for a result (a Markdown table on standard output, the same rows as JSON where
--out asks for it).

A bench adds the shared flags it takes with `add_common_args`, so that `--seed`, `--out` and
`--num-requests` mean one thing, with one help text, in every bench; its own flags stay its own.
"""

from __future__ import annotations

import argparse
import json
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


def percentiles(
    values: Iterable[float | None], qs: Sequence[float] = (50, 90, 99), method: str = "linear"
) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ...} (the keys follow qs), None where there are no values."""
    vals = [v for v in values if v is not None]
    return {f"p{q:g}": percentile(vals, q, method) for q in qs}


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: the header, its rule, a line a row (cells as str() gives them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path, obj: object) -> Path:
    """Write `obj` as indented JSON at `path` (its folder made as needed); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    return p


def write_result(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    out: str | Path | None = None,
    *,
    title: str | None = None,
) -> str:
    """Print a result as a Markdown table and, where `out` names a file, write the same rows as
    JSON there (a list of {column: cell}). Returns the table's text."""
    text = markdown_table(header, rows)
    if title:
        print(title)
    print(text)
    if out is not None:
        write_json(out, [dict(zip(header, row)) for row in rows])
    return text
