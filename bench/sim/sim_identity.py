"""The simulator's outputs on a grid of configurations, for checking that a refactor changes
nothing: summary.json (without its wall-clock keys), requests.csv, iterations.csv, and every
batch the schedulers formed (chunks, decodes, preemptions, swaps and host-tier copies, with the
KV block ids each chunk runs with), each hashed.

    python bench/sim/sim_identity.py --out runs/identity-before          # on the old commit
    python bench/sim/sim_identity.py --out runs/identity-after           # on the new one
    python bench/sim/sim_identity.py --diff runs/identity-before runs/identity-after

Run the first from a `git worktree` of the old commit. The grid covers every policy, every
chunking mode, recompute / swap / auto preemption under memory pressure, the prefix cache off,
on the device and with a host tier (on Mooncake's conversation trace, which carries prefix
hash ids), kvp 2, spp 2, two and four replicas under each dispatcher, multi-prefill and space
sharing off, prefill-only iterations, priority classes, and the three predictors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from medha.benchmark.harness import add_common_args
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.sim.metrics.summary import WALL_CLOCK_KEYS
from medha.sim.runner import RunSpec, simulate, write_run
from medha.sim.simulator import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig
from medha.utils.dataclass_cli import dataclass_from_args

SHAREGPT = dict(trace="sharegpt", qps=4.0, num_requests=160, seed=1)
LONG_MIX = dict(trace="sharegpt", qps=0.5, num_requests=30, long_fraction=0.1, seed=2)
MOONCAKE = dict(trace="mooncake_conv", num_requests=300, time_scale=0.5)
TIGHT_KV = dict(kv_memory_gb=1.0)  # llama-3-8b on one a100: 8,192 tokens, 512 blocks of 16
TP8 = dict(tp=8)  # 8 A100s: room for the long mix's 660K-token requests
PRIORITY_MIX = "REALTIME:0.1,HIGH:0.2,NORMAL:0.4,LOW:0.3"


def configs() -> list[tuple[str, dict, dict, dict, dict]]:
    """(name, cluster, parallel, scheduler, workload) keyword arguments of every run."""
    out = []

    def add(name, cluster=None, parallel=None, scheduler=None, workload=None):
        # a name is a configuration's key in digests.json: two of one name would hide one
        assert all(name != o[0] for o in out), f"two configurations named {name}"
        out.append((name, cluster or {}, parallel or {}, scheduler or {}, workload or SHAREGPT))

    policies = ("fcfs", "edf", "lrs", "lars", "srpt", "deferred", "aligned", "priority", "pla")
    for policy in policies:
        for chunking in ("adaptive", "static:512", "none"):
            add(f"{policy}-{chunking}", scheduler=dict(policy=policy, chunking=chunking))
    for policy in ("lars", "edf", "priority", "fcfs"):
        for mode in ("recompute", "swap", "auto"):
            add(
                f"{policy}-{mode}-tightkv",
                cluster=TIGHT_KV,
                scheduler=dict(policy=policy, preemption_mode=mode, swap_space_gb=0.5),
                workload={**SHAREGPT, "qps": 12.0, "priority_mix": PRIORITY_MIX},
            )
    for policy in ("lars", "fcfs", "edf"):
        for cache in ("off", "device", "device+host"):
            add(
                f"{policy}-prefix-{cache}",
                cluster=dict(kv_memory_gb=20.0),
                scheduler=dict(policy=policy, prefix_cache=cache, host_cache_gb=8.0),
                workload=MOONCAKE,
            )
    add(
        "lars-prefix-host-swap",
        cluster=dict(kv_memory_gb=16.0),
        scheduler=dict(prefix_cache="device+host", preemption_mode="swap", host_cache_gb=4.0),
        workload=MOONCAKE,
    )
    add(
        "priority-prefix-host-auto",
        cluster=dict(kv_memory_gb=16.0),
        scheduler=dict(
            policy="priority", prefix_cache="device+host", preemption_mode="auto", host_cache_gb=4.0
        ),
        workload={**MOONCAKE, "priority_mix": PRIORITY_MIX},
    )
    for policy in ("lars", "fcfs"):
        add(
            f"{policy}-kvp2",
            parallel=dict(tp=8, kvp=2),
            scheduler=dict(policy=policy),
            workload=LONG_MIX,
        )
        add(
            f"{policy}-spp2",
            parallel=dict(tp=8, spp=2),
            scheduler=dict(policy=policy),
            workload=LONG_MIX,
        )
    add("lars-tp8-spp2-kvp2", parallel=dict(tp=8, spp=2, kvp=2), workload=LONG_MIX)
    add(
        "lars-static-spp2",
        parallel=dict(tp=4, spp=2),
        scheduler=dict(chunking="static:512"),
        workload=LONG_MIX,
    )
    for dispatcher in ("round_robin", "least_work", "pla"):
        add(f"lars-2rep-{dispatcher}", cluster=dict(replicas=2, dispatcher=dispatcher))
    # the dispatchers that read a replica's queue by its rules (replica_rules), without and
    # with prefix hits
    for dispatcher in ("slack", "prefix"):
        add(f"lars-2rep-by-{dispatcher}", cluster=dict(replicas=2, dispatcher=dispatcher))
        add(
            f"lars-2rep-by-{dispatcher}-cached",
            cluster=dict(replicas=2, dispatcher=dispatcher, kv_memory_gb=20.0),
            scheduler=dict(prefix_cache="device"),
            workload=MOONCAKE,
        )
    add(
        "pla-4rep-pla",
        cluster=dict(replicas=4, dispatcher="pla"),
        scheduler=dict(policy="pla"),
        workload={**SHAREGPT, "qps": 16.0, "num_requests": 300},
    )
    add(
        "lars-2rep-prefix",
        cluster=dict(replicas=2, dispatcher="least_work", kv_memory_gb=20.0),
        scheduler=dict(prefix_cache="device"),
        workload=MOONCAKE,
    )
    add("lars-no-multiprefill", scheduler=dict(multi_prefill=False))
    add(
        "lars-no-space-sharing",
        parallel=TP8,
        scheduler=dict(space_sharing=False),
        workload=LONG_MIX,
    )
    add("lars-long-mix", parallel=TP8, workload=LONG_MIX)
    add("edf-long-mix", parallel=TP8, scheduler=dict(policy="edf"), workload=LONG_MIX)
    add("fcfs-prefill-only", scheduler=dict(chunking="none", prefill_only_iterations=True))
    add(
        "deferred-k4-prefill-only",
        scheduler=dict(
            policy="deferred",
            chunking="none",
            prefill_only_iterations=True,
            departure_threshold=4,
            batch_cap=16,
            max_num_seqs=16,
        ),
    )
    add("lars-tpot-0.1", scheduler=dict(tpot_target_s=0.1))
    add(
        "aligned-padded",
        cluster=dict(predictor="roofline-padded"),
        scheduler=dict(policy="aligned", aligned_min_batch=4),
    )
    add("lars-profiled", cluster=dict(predictor="profiled"))
    add(
        "fcfs-static-profiled",
        cluster=dict(predictor="profiled"),
        scheduler=dict(chunking="static:512"),
    )
    add(
        "pla-fixed-window",
        scheduler=dict(policy="pla", pla_adaptive=False, pla_w_max_s=0.05),
    )
    add(
        "priority-edf-base",
        scheduler=dict(policy="priority", priority_base="lars"),
        workload={**SHAREGPT, "priority_mix": PRIORITY_MIX},
    )
    return out


class BatchRecorder:
    """Every batch each replica's scheduler forms, with the block ids of each chunk at the time
    it was formed (what an engine would run it with)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.replicas: dict[int, int] = {}
        self._original = ReplicaScheduler.schedule

    def __enter__(self):
        recorder, original = self, self._original

        def schedule(sched, now):
            batch = original(sched, now)
            if batch is not None:
                row = describe(sched, batch)
                # replicas by order of their first batch
                row["replica"] = recorder.replicas.setdefault(id(sched), len(recorder.replicas))
                recorder.lines.append(json.dumps(row))
            return batch

        ReplicaScheduler.schedule = schedule
        return self

    def __exit__(self, *exc) -> None:
        ReplicaScheduler.schedule = self._original


def describe(sched: ReplicaScheduler, batch) -> dict:
    tables = sched.blocks.blocks_of

    def chunk(c):
        rid = c.request.request_id
        return [rid, c.start, c.num_tokens, c.samples, list(tables(rid))]

    return {
        "id": batch.batch_id,
        "at": repr(batch.scheduled_at_s),
        "time": repr(batch.predicted_time_s),
        "swap_time": repr(batch.swap_time_s),
        "decode_kv": batch.decode_kv_sum,
        "decodes": [chunk(c) for c in batch.decodes],
        "prefills": [chunk(c) for c in batch.prefills],
        "preempted": [r.request_id for r in batch.preempted],
        "swap_in": [[s.request.request_id, s.device_blocks, s.host_blocks] for s in batch.swap_in],
        "swap_out": [
            [s.request.request_id, s.device_blocks, s.host_blocks] for s in batch.swap_out
        ],
        "cache_out": batch.cache_out,
        "cache_in": batch.cache_in,
    }


def run_one(name, cluster, parallel, scheduler, workload, out: Path, keep: bool) -> dict:
    # flat setting names, as the flags give them (the same on old and new commits)
    spec = RunSpec(
        name=name,
        cluster=dataclass_from_args(ClusterConfig, argparse.Namespace(**cluster)),
        parallel=ParallelConfig(**parallel),
        scheduler=dataclass_from_args(SchedulerConfig, argparse.Namespace(**scheduler)),
    )
    with BatchRecorder() as rec:
        t0 = time.perf_counter()
        outcome = simulate(spec, WorkloadConfig(**workload))
        wall = time.perf_counter() - t0
    d = out / name
    write_run(d, outcome, plots=False)
    summary = json.loads((d / "summary.json").read_text())
    for section in summary.values():
        if isinstance(section, dict):
            for key in WALL_CLOCK_KEYS:
                section.pop(key, None)
    (d / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = rec.lines
    (d / "batches.jsonl").write_text("\n".join(lines) + "\n")
    digests = {
        f: hashlib.sha256((d / f).read_bytes()).hexdigest()
        for f in ("summary.json", "requests.csv", "iterations.csv", "batches.jsonl")
    }
    if not keep:
        # up to hundreds of MB a configuration (17 GB the grid); --diff needs only the digests
        # and summary.json
        for f in ("requests.csv", "iterations.csv", "batches.jsonl"):
            (d / f).unlink()
    return {"digests": digests, "batches": len(lines), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap, out=None, out_help="directory for the outputs and digests.json")
    ap.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --out dirs")
    ap.add_argument("--only", default=None, help="run the configurations whose name has this")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep each configuration's requests.csv, iterations.csv and batches.jsonl (17 GB "
        "for the grid; by default only their digests and summary.json stay)",
    )
    args = ap.parse_args()
    if args.diff:
        sys.exit(diff(*map(Path, args.diff)))
    if not args.out:
        ap.error("--out or --diff is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    digests = out / "digests.json"
    # resumable: configurations already in digests.json are not run again
    results = json.loads(digests.read_text()) if digests.exists() else {}
    grid = [c for c in configs() if args.only is None or args.only in c[0]]
    for i, (name, *kw) in enumerate(grid, 1):
        if name in results:
            continue
        results[name] = r = run_one(name, *kw, out, args.keep)
        digests.write_text(json.dumps(results, indent=1) + "\n")
        print(f"[{i}/{len(grid)}] {name}: {r['batches']} batches, {r['wall_s']:.1f} s", flush=True)


def config_moves(before: Path, after: Path) -> str:
    """What differs between two summary.json files: only the echoed config (and how), or
    more."""
    a, b = (json.loads((d / "summary.json").read_text()) for d in (before, after))
    ca, cb = a.pop("config", {}), b.pop("config", {})
    if a != b:
        return "summary.json differs beyond its echoed config"
    flat_a = {
        (k, section): v for section, d in ca.items() if isinstance(d, dict) for k, v in d.items()
    }
    flat_b = {
        (k, section): v for section, d in cb.items() if isinstance(d, dict) for k, v in d.items()
    }
    moved = sorted(
        f"{k}: {sa} -> {sb}"
        for (k, sa), v in flat_a.items()
        for (k2, sb), v2 in flat_b.items()
        if k == k2 and sa != sb and v == v2
    )
    changed = sorted(
        str(k) for k in set(flat_a) ^ set(flat_b) if not any(k[0] in m.split(":")[0] for m in moved)
    )
    changed += sorted(str(k) for k in set(flat_a) & set(flat_b) if flat_a[k] != flat_b[k])
    top = {k for k in ca if not isinstance(ca[k], dict) and ca[k] != cb.get(k)}
    return (
        f"only the echoed config differs: moved {moved or 'nothing'}; other changes "
        f"{changed + sorted(top) or 'none'}"
    )


def diff(before: Path, after: Path) -> int:
    a = json.loads((before / "digests.json").read_text())
    b = json.loads((after / "digests.json").read_text())
    same = differ = config_only = 0
    for name in a:
        if name not in b:
            print(f"{name}: missing after")
            differ += 1
            continue
        bad = [f for f, h in a[name]["digests"].items() if b[name]["digests"].get(f) != h]
        if bad:
            how = config_moves(before / name, after / name) if "summary.json" in bad else ""
            if bad == ["summary.json"] and how.startswith("only"):
                config_only += 1
            else:
                differ += 1
            print(f"{name}: differs in {', '.join(bad)}" + (f"\n  {how}" if how else ""))
        else:
            same += 1
    print(
        f"{same} of {len(a)} configurations byte-identical, {config_only} identical but for "
        f"the config summary.json echoes, {differ} differ"
    )
    wa = sum(r["wall_s"] for r in a.values())
    wb = sum(r["wall_s"] for r in b.values() if r)
    print(f"wall time of the grid: {wa:.1f} s before, {wb:.1f} s after")
    return 1 if differ else 0


if __name__ == "__main__":
    main()
