"""`medha simulate`: run one configuration, or several on the identical request list, and write
the results where the user asked, all or nothing."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from medha.core.request import Request
from medha.perf import ParallelConfig
from medha.perf.swap_cost import SwapCost
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.prefix_cache import reusable_prefix_tokens
from medha.sim.metrics.iteration_log import IterationLog
from medha.sim.metrics.summary import (
    RequestMetrics,
    preemption_summary,
    prefix_cache_summary,
    summarize,
)
from medha.sim.simulator import KV_BLOCK_SIZE, ClusterConfig, SimResult, Simulator
from medha.sim.workload.generator import WorkloadConfig, build_requests
from medha.utils.dataclass_cli import to_flat


@dataclass
class RunSpec:
    """Everything that defines one simulated configuration."""

    name: str = "run"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # prompt tokens from which a request counts as long in the metrics (None: the scheduler's
    # resolved long_prefill_threshold, the one its "one long prefill per batch" rule uses)
    long_threshold: int | None = None

    def __post_init__(self) -> None:
        t = self.long_threshold
        if t is not None and not (isinstance(t, int) and t >= 1):
            raise ValueError(f"long_threshold must be a positive integer, got {t!r}")

    def to_json(self) -> dict:
        cluster = to_flat(self.cluster)
        if self.cluster.system == "medha":
            # the baseline's settings do not apply to medha's runs, whose echoed config stays
            # what it was before there was a baseline
            cluster = {
                k: v for k, v in cluster.items() if k != "system" and not k.startswith("loong_")
            }
        return {
            "name": self.name,
            "cluster": cluster,
            "parallel": dataclasses.asdict(self.parallel),
            "scheduler": to_flat(self.scheduler),
            "long_threshold": self.long_threshold,
        }


@dataclass
class RunOutcome:
    spec: RunSpec
    summary: dict
    rows: list[RequestMetrics]
    result: SimResult


def simulate(spec: RunSpec, workload: WorkloadConfig, progress: bool = False) -> RunOutcome:
    if spec.cluster.system == "loongserve":
        from medha.sim.baselines.loongserve import LoongServeSimulator

        sim = LoongServeSimulator(spec.cluster, spec.parallel, spec.scheduler)
        # each elastic instance logs its own iterations, as a replica does
        num_replicas = spec.cluster.loong.instances
    else:
        sim = Simulator(spec.cluster, spec.parallel, spec.scheduler)
        num_replicas = spec.cluster.replicas
    requests = build_requests(workload, sim.max_model_len)
    result = sim.run(requests, progress=progress)
    hw = sim.predictor.hardware
    long_threshold = spec.long_threshold or sim.scheduler_config.long_prefill_threshold
    summary, rows = summarize(
        requests,
        result.log,
        config={
            **spec.to_json(),
            "long_threshold": long_threshold,
            "workload": dataclasses.asdict(workload),
        },
        long_threshold=long_threshold,
        tpot_target_s=sim.scheduler_config.tpot_target_s,
        model=sim.predictor.model,
        dtype_bytes=hw.dtype_bytes,
        num_devices=result.num_devices,
        num_replicas=num_replicas,
        spp=spec.parallel.spp,
        peak_flops=hw.peak_flops,
        mem_bw=hw.mem_bw,
        wall_s=result.wall_s,
        setup_s=result.setup_s,
    )
    # per device, 16-token blocks as kv_blocks_per_replica makes them
    block_bytes = SwapCost(sim.predictor, KV_BLOCK_SIZE).block_bytes
    summary["preemption"] = preemption_summary(result.scheduler_stats, block_bytes)
    if sim.scheduler_config.prefix_cache != "off":
        summary["prefix_cache"] = prefix_cache_summary(
            rows,
            reusable_prefix_tokens(requests, KV_BLOCK_SIZE),
            sim.predictor.model,
            result.scheduler_stats,
        )
    return RunOutcome(spec, summary, rows, result)


class OutputDirError(Exception):
    """--out cannot take the results; the message names the path and why."""


@contextlib.contextmanager
def output_dir(out: str | Path, overwrite: bool):
    """Yield a fresh directory that becomes `out` only if the block succeeds, so that a failed
    run never leaves a directory that looks like a finished one. Missing parents are created.

    `out` may be absent or an empty directory; with `overwrite` also a directory with files, or
    a symlink, which the new directory replaces (what the link points to is left alone). A
    file is never replaced."""
    out = Path(out)
    _check_out(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except (FileExistsError, NotADirectoryError):  # mkdir met a file on the way
        blocker = next(p for p in out.parents if os.path.lexists(p))
        raise OutputDirError(f"--out {out}: {blocker} is not a directory") from None
    except OSError as e:
        raise OutputDirError(
            f"--out {out}: cannot create a directory in {out.parent} ({e.strerror})"
        ) from None
    try:
        yield tmp
        _check_out(out, overwrite)  # a run takes a while: something may be at `out` by now
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    trash = None
    try:
        if os.path.lexists(out):  # lexists: a dangling symlink too
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")  # a symlink moves itself, not what it points to
        os.replace(tmp, out)
    except OSError as e:  # e.g. --out .
        shutil.rmtree(tmp, ignore_errors=True)
        if trash is not None:
            with contextlib.suppress(OSError):
                trash.rmdir()  # when empty; a moved `out` stays there, not lost
        raise OutputDirError(f"--out {out}: cannot replace it ({e.strerror})") from None
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _check_out(out: Path, overwrite: bool) -> None:
    try:
        if out.is_symlink():
            if not overwrite:
                raise OutputDirError(
                    f"--out {out} is a symlink; pass --overwrite to replace "
                    "the link (what it points to is left alone)"
                )
        elif out.exists():
            if not out.is_dir():
                raise OutputDirError(
                    f"--out {out} is a file, not a directory; --overwrite replaces only a directory"
                )
            if not overwrite and any(out.iterdir()):
                raise OutputDirError(f"--out {out} exists and is not empty; pass --overwrite")
    except OSError as e:  # e.g. a directory on the way that may not be read
        raise OutputDirError(f"--out {out}: {e.strerror}") from None


REQUEST_COLUMNS = [
    "request_id",
    "class",
    "arrival_s",
    "prompt_len",
    "output_len",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "normalized_e2e_s",
    "scheduling_delay_s",
    "ttft_deadline_s",
    "ttft_met",
    "tpot_met",
    "preemptions",
    "tbt_p50_s",
    "tbt_p99_s",
    "tbt_max_s",
    "priority",
    "swaps",
    "cached_tokens",
    "host_cached_tokens",
]


def _fmt(x) -> str:
    return "" if x is None else (f"{x:.6g}" if isinstance(x, float) else str(x))


ITERATION_COLUMNS = [
    "replica",
    "start_s",
    "end_s",
    "latency_s",
    "num_decodes",
    "decode_kv",
    "num_prefills",
    "prefill_tokens",
]


def write_run(
    out: Path, outcome: RunOutcome, plots: bool = True, token_times: bool = False
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(outcome.summary, indent=1) + "\n")
    _write_requests(out / "requests.csv", outcome.rows)
    log = outcome.result.log
    _write_iterations(out / "iterations.csv", log)
    if token_times:
        _write_token_times(out / "token_times.jsonl", outcome.result.requests)
    if plots:
        from medha.sim.metrics.plots import run_plots  # matplotlib: only when it draws

        run_plots(out, outcome.rows, log)


def _write_requests(path: Path, rows: list[RequestMetrics]) -> None:
    """requests.csv: one row per request, REQUEST_COLUMNS."""
    import numpy as np

    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(REQUEST_COLUMNS)
        for m in rows:
            tbt = (
                np.percentile(m.tbt_s, [50, 99]).tolist() + [max(m.tbt_s)]
                if m.tbt_s
                else [None] * 3
            )
            w.writerow(
                [
                    _fmt(x)
                    for x in (
                        m.request_id,
                        m.request_class,
                        m.arrival_s,
                        m.prompt_len,
                        m.output_len,
                        m.ttft_s,
                        m.tpot_s,
                        m.e2e_s,
                        m.normalized_e2e_s,
                        m.scheduling_delay_s,
                        m.ttft_deadline_s,
                        int(m.ttft_met),
                        int(m.tpot_met),
                        m.preemptions,
                        *tbt,
                        m.priority,
                        m.swaps,
                        m.cached_tokens,
                        m.host_cached_tokens,
                    )
                ]
            )


def _write_iterations(path: Path, log: IterationLog) -> None:
    """iterations.csv: one row per batch of the IterationLog, ITERATION_COLUMNS."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(ITERATION_COLUMNS)
        for row in zip(
            log.replica,
            log.start_s,
            log.end_s,
            log.latency_s,
            log.num_decodes,
            log.decode_kv,
            log.num_prefills,
            log.prefill_tokens,
        ):
            w.writerow([_fmt(x) for x in row])


def _write_token_times(path: Path, requests: list[Request]) -> None:
    """token_times.jsonl: each request's arrival and the times of its tokens."""
    with path.open("w") as fh:
        for r in requests:
            fh.write(
                json.dumps(
                    {
                        "request_id": r.request_id,
                        "arrival_s": r.arrival_s,
                        "token_times_s": r.token_times_s,
                    }
                )
                + "\n"
            )


COMPARE_COLUMNS = [
    ("short TTFT p50", ("by_class", "short", "ttft_s", "p50")),
    ("short TTFT p99", ("by_class", "short", "ttft_s", "p99")),
    ("long TTFT p50", ("by_class", "long", "ttft_s", "p50")),
    ("long TTFT p99", ("by_class", "long", "ttft_s", "p99")),
    ("TPOT p50", ("tpot_s", "p50")),
    ("TPOT p99", ("tpot_s", "p99")),
    ("long done", ("by_class", "long", "count")),
    ("SLO attainment", ("slo_attainment",)),
    ("output tok/s", ("throughput", "output_tokens_per_s")),
]


def _get(d: dict, path: tuple):
    for k in path:
        if d is None:
            return None
        d = d.get(k)
    return d


def compare_table(outcomes: list[RunOutcome]) -> tuple[str, list[list[str]]]:
    header = ["run"] + [c for c, _ in COMPARE_COLUMNS]
    rows = []
    for o in outcomes:
        row = [o.spec.name]
        for label, path in COMPARE_COLUMNS:
            v = _get(o.summary, path)
            if v is None:
                row.append("-")
            elif "count" in path:
                row.append(str(v))
            elif label == "SLO attainment":
                row.append(f"{v:.1%}")
            elif "tok/s" in label:
                row.append(f"{v:.0f}")
            else:
                row.append(f"{v:.3f} s")
        rows.append(row)
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(md), [header] + rows


def write_compare(out: Path, outcomes: list[RunOutcome], plots: bool = True) -> str:
    table, rows = compare_table(outcomes)
    (out / "compare.md").write_text(table + "\n")
    with (out / "compare.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    if plots:
        from medha.sim.metrics.plots import compare_plots

        compare_plots(out, {o.spec.name: o.rows for o in outcomes})
    return table
