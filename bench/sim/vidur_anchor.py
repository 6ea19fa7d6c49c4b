"""Vidur 0.0.26 on the simulator-speed workload of bench/sim/sim_speed.py, for an outside anchor.

Workload: the first N (default 10,000) requests of medha/data/traces/splitwise_conv.csv replayed
at the trace's own arrival times; Llama-3-8B (Vidur `meta-llama/Llama-3-8B`) on one A100
(`a100`, node `a100_dgx`), TP1, PP1, one replica; Vidur's `sarathi` replica scheduler with
chunk_size 512 and batch_size_cap 128; Vidur's default random-forest execution-time predictor.
Plots, chrome/JSON traces and wandb are off; Vidur's in-memory metrics collection stays on.

Install Vidur into its own virtualenv (never into the project's Python; Vidur 0.0.26 does not
need torch):

    python3 -m venv /tmp/vidur-venv
    /tmp/vidur-venv/bin/pip install vidur==0.0.26

Run from the repository root (this script imports nothing from medha):

    /tmp/vidur-venv/bin/python bench/sim/vidur_anchor.py [--num-requests 10000]

It prints one JSON line: requests, completed, wall_s (the event loop only), requests_per_wall_s,
simulated_s (time of the last event), batches, setup_s (predictor training or cache load: about
9 minutes on 2 cores the first time, under 1 s afterwards).

Profiling data. Vidur 0.0.26 ships no profiling data: it downloads it from the Hugging Face hub
at run time, which this machine cannot reach. So the predictor is trained on (a) Vidur's own
A100 Llama-3-8B MLP/linear-op profile, which this repository bundles unchanged as
medha/perf/profiles/a100_Meta-Llama-3-8B_mlp.csv, and (b) a synthetic attention profile
(roofline formulas below) in Vidur's attention.csv schema, unless --attention-profile names a
real Vidur attention.csv. Vidur's hub downloads are replaced by these local folders. Trained
models and predictions are cached under --cache-dir, so the second run skips the training
(delete that folder after changing a profile: Vidur keys its cache by dataset name only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pandas as pd  # noqa: E402  (Vidur's own dependency)

REPO = Path(__file__).resolve().parents[2]
MODEL, DEVICE, NODE = "meta-llama/Llama-3-8B", "a100", "a100_dgx"
COMPUTE_DATASET, NETWORK_DATASET = "local/vidur-a100-llama-3-8b", "local/vidur-a100-dgx"


def synthetic_attention(n_embd=4096, n_q=32, n_kv=8, max_tokens=16384) -> pd.DataFrame:
    """Per-layer attention ms on an A100 by roofline: 150 TFLOP/s, 1.5 TB/s, fixed floors."""
    kv_bytes = 2 * 2 * n_kv * (n_embd // n_q)  # K and V, bf16, per token
    rows = []
    for c in list(range(32, 1025, 32)) + [1536, 2048, 3072, 4096]:  # prefill chunks
        for k in range(0, max_tokens + 1, 512):
            flops = 4 * c * (k + c / 2) * n_embd
            t = 0.02 + 1e3 * max(flops / 150e12, ((k + c) * kv_bytes + 4 * c * n_embd) / 1.5e12)
            rows.append((1, c, k, t, 0.0))
    for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128):  # decode batches
        for k in range(512, max_tokens + 1, 512):
            rows.append((b, 0, k, 0.0, 0.01 + 0.0005 * b + 1e3 * b * k * kv_bytes / 1.5e12))
    df = pd.DataFrame(
        rows,
        columns=[
            "batch_size",
            "prefill_chunk_size",
            "kv_cache_size",
            "time_stats.attn_prefill.median",
            "time_stats.attn_decode.median",
        ],
    )
    tokens = df[["batch_size", "prefill_chunk_size"]].max(axis=1)
    df["time_stats.attn_kv_cache_save.median"] = 0.005 + 1e3 * tokens * kv_bytes / 1.0e12
    df["n_embd"], df["n_q_head"], df["n_kv_head"] = n_embd, n_q, n_kv
    df["block_size"], df["num_tensor_parallel_workers"] = 16, 1
    return df


def write_dataset(folder: Path, config: dict, files: dict) -> str:
    """A local stand-in for one Vidur profiling dataset on the hub: config.json + *.csv.xz."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name, df in files.items():
        if not (folder / name).exists():
            df.to_csv(folder / name, index=False, compression="xz")
    return str(folder)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness = runpy.run_path(str(REPO / "medha" / "benchmark" / "harness.py"))
    harness["add_common_args"](ap, num_requests=10_000)
    ap.add_argument("--trace", default=str(REPO / "medha/data/traces/splitwise_conv.csv"))
    ap.add_argument(
        "--mlp-profile", default=str(REPO / "medha/perf/profiles/a100_Meta-Llama-3-8B_mlp.csv")
    )
    ap.add_argument(
        "--attention-profile",
        default=None,
        help="a real Vidur attention.csv (default: synthetic, see above)",
    )
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache/vidur_anchor"))
    args = ap.parse_args()

    import vidur.logger  # Vidur logs to stdout; keep stdout for the JSON line

    vidur.logger._default_handler.setStream(sys.stderr)
    vidur.logger._default_handler.flush = sys.stderr.flush

    from vidur.config import (
        CacheConfig,
        ClusterConfig,
        MetricsConfig,
        RandomForrestExecutionTimePredictorConfig,
        ReplicaConfig,
        SarathiSchedulerConfig,
        SimulationConfig,
        TraceRequestGeneratorConfig,
    )
    from vidur.entities import Batch
    from vidur.execution_time_predictor import sklearn_execution_time_predictor as sk
    from vidur.simulator import Simulator
    from vidur.utils.random import set_seeds

    cache = Path(args.cache_dir)
    trace = pd.read_csv(args.trace).head(args.num_requests)
    longest = int((trace.num_prefill_tokens + trace.num_decode_tokens).max())
    max_tokens = max(16384, math.ceil(longest / 4096) * 4096)  # Vidur's default is 2M

    attention = (
        pd.read_csv(args.attention_profile)
        if args.attention_profile
        else synthetic_attention(max_tokens=max_tokens)
    )
    tag = "real" if args.attention_profile else "synthetic"
    datasets = {
        COMPUTE_DATASET: write_dataset(
            cache / f"profiles/compute-{tag}",
            {"model": MODEL, "device_sku": DEVICE},
            {"mlp.csv.xz": pd.read_csv(args.mlp_profile), "attention.csv.xz": attention},
        ),
        NETWORK_DATASET: write_dataset(  # TP1/PP1 reads no network rows
            cache / "profiles/network",
            {"sku": NODE},
            {"all_reduce.csv.xz": pd.DataFrame(), "send_recv.csv.xz": pd.DataFrame()},
        ),
    }

    def local_snapshot(repo_id, **_):
        if repo_id in datasets:
            return datasets[repo_id]
        raise FileNotFoundError(f"{repo_id}: not available offline")

    sk.snapshot_download = local_snapshot  # Vidur's hub download -> the local folders

    tmp = Path(tempfile.mkdtemp(prefix="vidur_anchor_"))
    pd.DataFrame(
        {
            "Date": "2023-08-21",
            "Time": trace.arrived_at,
            "PromptTokenCount": trace.num_prefill_tokens,
            "CompletionTokenCount": trace.num_decode_tokens,
        }
    ).to_csv(tmp / "trace.csv", index=False)

    config = SimulationConfig(
        seed=42,
        cluster_config=ClusterConfig(
            num_replicas=1,
            replica_config=ReplicaConfig(
                model_name=MODEL,
                device=DEVICE,
                network_device=NODE,
                tensor_parallel_size=1,
                num_pipeline_stages=1,
            ),
            cache_config=CacheConfig(),
            replica_scheduler_config=SarathiSchedulerConfig(chunk_size=512, batch_size_cap=128),
        ),
        request_generator_config=TraceRequestGeneratorConfig(
            trace_file=str(tmp / "trace.csv"),
            date="2023-08-21",
            prefill_scale_factor=1,
            decode_scale_factor=1,
            time_scale_factor=1,
            max_tokens=max_tokens,
        ),
        execution_time_predictor_config=RandomForrestExecutionTimePredictorConfig(
            model_profiling_dataset=COMPUTE_DATASET,
            network_profiling_dataset=NETWORK_DATASET,
            prediction_max_tokens_per_request=max_tokens,
            cache_dir=str(cache / "vidur_cache"),
        ),
        metrics_config=MetricsConfig(
            output_dir=str(tmp / "out"),
            write_metrics=True,
            store_plots=False,
            enable_chrome_trace=False,
            write_json_trace=False,
            wandb_project=None,
        ),
    )
    set_seeds(config.seed)

    t0 = time.perf_counter()
    sim = Simulator(config)  # trains the predictor, or loads it from the cache
    setup_s = time.perf_counter() - t0
    requests = [event._request for _, event in sim._event_queue]

    loop_end = []
    write_output = sim._write_output
    sim._write_output = lambda: (loop_end.append(time.perf_counter()), write_output())
    t1 = time.perf_counter()
    sim.run()
    wall_s = loop_end[0] - t1
    shutil.rmtree(tmp, ignore_errors=True)  # the converted trace and Vidur's metric files

    print(
        json.dumps(
            {
                "tool": "vidur 0.0.26",
                "requests": len(requests),
                "completed": sum(r.completed for r in requests),
                "wall_s": round(wall_s, 3),
                "requests_per_wall_s": round(len(requests) / wall_s, 1),
                "simulated_s": round(sim._time, 3),
                "batches": Batch._id + 1,
                "setup_s": round(setup_s, 3),
                "attention_profile": tag,
            }
        )
    )


if __name__ == "__main__":
    main()
