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


# A goodput run's load and targets as multiples of the machine's own pace: where a trace's
# prompts take `alone_s` on average each by itself, a server saturates near 1/alone_s requests a
# second. Fractions of that rate: below, near and at saturation. The TTFT targets: twice that
# mean time, and a second plus each prompt's own time at the trace's pace (alone_s over its mean
# prompt, a token). On the 2-core AMX Xeon the rates and targets of the runs docs/vllm.md
# reports came from a mean of about 1 s (0.35, 0.7 and 1.0 req/s; 2 s; 1 s + 0.5 ms a token).
PACED_RATE_FRACTIONS = (0.35, 0.7, 1.0)
PACED_TPOT_S = 0.2  # a reading pace's looser end; the decode steps of a CPU take 25-50 ms
# the trace's prompt lengths timed alone for that mean: the middles of its five quintiles
PACED_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)


def _two_digits(x: float) -> float:
    return float(f"{x:.2g}")


def paced_load(alone_s: float, mean_prompt: float) -> tuple[list[float], list[str]]:
    """The Poisson rates and the --slo specs (parse_slo's syntax) of a goodput run on a machine
    where a trace's prompts, `mean_prompt` tokens on average, take `alone_s` seconds each alone
    on average; rounded to two digits so that the command that repeats them reads as one."""
    if not (alone_s > 0 and mean_prompt >= 1):
        raise ValueError(f"a prompt's time alone {alone_s!r} s and mean length {mean_prompt!r}")
    rates = [_two_digits(f / alone_s) for f in PACED_RATE_FRACTIONS]
    slos = [
        f"ttft={_two_digits(2 * alone_s):g},tpot={PACED_TPOT_S:g}",
        f"ttft=1+{_two_digits(alone_s / mean_prompt):g}*prompt,tpot={PACED_TPOT_S:g}",
    ]
    return rates, slos


def paced_lengths(prompts: Sequence[int]) -> list[int]:
    """The prompt lengths whose times alone average to the trace's mean time alone: one at the
    middle of each fifth of the trace's lengths (a prompt's time grows faster than its length,
    so the mean prompt's time alone would understate the mean)."""
    if not prompts:
        raise ValueError("a trace with no prompts")
    return [int(np.quantile(prompts, q, method="nearest")) for q in PACED_QUANTILES]


def times_alone(url: str, prompt_lens: Sequence[int], **bench) -> list[float]:
    """The TTFT of a prompt of each length (one output token), each sent alone to the server at
    `url`, after one short warm-up request. `bench`: more BenchConfig fields (model, endpoint)."""
    import tempfile

    from medha.benchmark.config import BenchConfig
    from medha.benchmark.load_generator import run_bench

    with tempfile.TemporaryDirectory(prefix="medha-times-alone-") as out:
        times = []
        for i, prompt in enumerate([16, *prompt_lens]):
            cfg = BenchConfig(url=url, workload=f"prompt={prompt},output=1", qps=1.0,
                              num_requests=1, seed=i, out=f"{out}/{i}", **bench)  # fmt: skip
            summary = run_bench(cfg, progress=False)
            if summary["client"]["errors"]:
                raise RuntimeError(f"a {prompt}-token prompt alone failed at {url}")
            if summary["ttft_s"]["p50"] is None:  # its one token streamed no text to time
                raise RuntimeError(f"a {prompt}-token prompt alone at {url} streamed no text")
            times.append(summary["ttft_s"]["p50"])
    return times[1:]


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
