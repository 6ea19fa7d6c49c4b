"""PNG plots of a run, and of several runs overlaid."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from medha.sim.metrics.iteration_log import IterationLog  # noqa: E402
from medha.sim.metrics.summary import RequestMetrics  # noqa: E402


def _cdf(ax, values, label: str) -> None:
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=float))
    if v.size:
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{label} (n={v.size})")


def _finish(ax, fig, path: Path, xlabel: str, title: str, log_x: bool = True) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_cdfs(out: Path, rows: list[RequestMetrics]) -> list[Path]:
    """TTFT and TPOT CDFs by request class (the simulator's and `medha bench`'s)."""
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in ("short", "long"):
        _cdf(ax, [m.ttft_s for m in rows if m.request_class == c], c)
    paths.append(out / "ttft_cdf.png")
    _finish(ax, fig, paths[-1], "TTFT (s)", "Time to first token by request class")

    fig, ax = plt.subplots(figsize=(6, 4))
    _cdf(ax, [m.tpot_s for m in rows], "all")
    for c in ("short", "long"):
        _cdf(ax, [m.tpot_s for m in rows if m.request_class == c], c)
    paths.append(out / "tpot_cdf.png")
    _finish(ax, fig, paths[-1], "TPOT (s)", "Time per output token")
    return paths


def run_plots(out: Path, rows: list[RequestMetrics], log: IterationLog) -> list[Path]:
    paths = latency_cdfs(out, rows)
    longest = max(rows, key=lambda m: m.prompt_len)
    times = [
        log.start_s[i] - longest.arrival_s
        for i, rid in zip(log.chunk_iteration, log.chunk_request)
        if rid == longest.request_id
    ]
    sizes = [n for n, rid in zip(log.chunk_tokens, log.chunk_request) if rid == longest.request_id]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(times, sizes, ".", markersize=3)
    ax.set_ylabel("chunk (tokens)")
    paths.append(out / "longest_request_chunks.png")
    _finish(
        ax,
        fig,
        paths[-1],
        "time since arrival (s)",
        f"Prefill chunks of the longest request ({longest.prompt_len} tokens)",
        log_x=False,
    )
    return paths


def compare_plots(out: Path, runs: dict[str, list[RequestMetrics]]) -> list[Path]:
    paths = []
    for c in ("short", "long"):
        if not any(m.request_class == c for rows in runs.values() for m in rows):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rows in runs.items():
            _cdf(ax, [m.ttft_s for m in rows if m.request_class == c], name)
        paths.append(out / f"ttft_cdf_{c}.png")
        _finish(ax, fig, paths[-1], "TTFT (s)", f"TTFT of {c} requests")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in runs.items():
        _cdf(ax, [m.tpot_s for m in rows], name)
    paths.append(out / "tpot_cdf.png")
    _finish(ax, fig, paths[-1], "TPOT (s)", "Time per output token")
    return paths
