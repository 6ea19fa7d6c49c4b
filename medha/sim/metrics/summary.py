"""Per-request metrics and the run summary (`summary.json`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from medha.core.request import DEFAULT_PRIORITY_CLASS, PRIORITY_CLASSES, Request
from medha.perf.model_specs import ModelSpec
from medha.sim.metrics.iteration_log import IterationLog

PERCENTILES = (("p50", 50), ("p90", 90), ("p99", 99))


def pct(values) -> dict[str, float | None]:
    """p50/p90/p99/mean/max of `values`; None everywhere when there are none."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return {k: None for k, _ in PERCENTILES} | {"mean": None, "max": None}
    out = {k: float(np.percentile(a, q)) for k, q in PERCENTILES}
    out["mean"] = float(a.mean())
    out["max"] = float(a.max())
    return out


@dataclass(slots=True)
class RequestMetrics:
    request_id: str
    request_class: str
    arrival_s: float
    prompt_len: int
    output_len: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    normalized_e2e_s: float | None
    scheduling_delay_s: float | None
    ttft_deadline_s: float
    ttft_met: bool
    tpot_met: bool
    preemptions: int
    tbt_s: list[float]
    priority: str = DEFAULT_PRIORITY_CLASS
    swaps: int = 0  # preemptions that swapped the KV out (the others recomputed)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (at the latest start)
    host_cached_tokens: int = 0  # of them, copied back from the host tier

    @property
    def slo_met(self) -> bool:
        return self.ttft_met and self.tpot_met


def request_metrics(r: Request, long_threshold: int, tpot_target_s: float) -> RequestMetrics:
    times = r.token_times_s
    ttft = times[0] - r.arrival_s if times else None
    tbt = [b - a for a, b in zip(times, times[1:])]
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    e2e = r.finish_s - r.arrival_s if r.finish_s is not None and times else None
    deadline = r.deadline_s - r.arrival_s
    target = r.tpot_target_s or tpot_target_s
    return RequestMetrics(
        request_id=r.request_id,
        request_class="long" if r.prompt_len >= long_threshold else "short",
        arrival_s=r.arrival_s,
        prompt_len=r.prompt_len,
        output_len=r.num_output_tokens,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        normalized_e2e_s=e2e / len(times) if e2e is not None else None,
        scheduling_delay_s=(
            r.first_scheduled_s - r.arrival_s if r.first_scheduled_s is not None else None
        ),
        ttft_deadline_s=deadline,
        ttft_met=ttft is not None and ttft <= deadline,
        tpot_met=tpot is None or tpot <= target,
        preemptions=r.num_preemptions,
        tbt_s=tbt,
        priority=r.priority_class or DEFAULT_PRIORITY_CLASS,
        swaps=r.num_swaps,
        cached_tokens=r.num_cached_tokens,
        host_cached_tokens=r.num_host_cached_tokens,
    )


def _class_summary(rows: list[RequestMetrics]) -> dict:
    return {
        "count": len(rows),
        "ttft_s": pct(m.ttft_s for m in rows),
        "tpot_s": pct(m.tpot_s for m in rows),
        "e2e_s": pct(m.e2e_s for m in rows),
        "slo_attainment": float(np.mean([m.slo_met for m in rows])) if rows else None,
    }


def utilization(
    log: IterationLog,
    model: ModelSpec,
    dtype_bytes: int,
    span_s: float,
    num_devices: int,
    num_replicas: int,
    spp: int,
    peak_flops: float,
    mem_bw: float,
) -> dict[str, float]:
    """Model FLOPs and bytes utilization over the whole simulated span, all devices.

    FLOPs: matmuls of every token plus the attention each chunk and decode executes. Bytes: the
    weights once per iteration plus every KV byte attention reads.
    """
    if not len(log) or span_s <= 0:
        return {"mfu": 0.0, "mbu": 0.0, "busy_fraction": 0.0}
    tokens = np.add(log.num_decodes, log.prefill_tokens, dtype=float)
    per_token = model.linear_flops(1)
    kv_token = model.kv_bytes_per_token(dtype_bytes)
    decode_kv = np.asarray(log.decode_kv, dtype=float)
    n = np.asarray(log.chunk_tokens, dtype=float)
    k = np.asarray(log.chunk_start, dtype=float)
    flops = per_token * tokens.sum()
    flops += (4.0 * n * (k + (n + 1) / 2)).sum() * model.q_size * model.num_layers
    flops += 4.0 * (decode_kv.sum() + sum(log.num_decodes)) * model.q_size * model.num_layers
    nbytes = model.num_params * dtype_bytes * len(log) + kv_token * (
        decode_kv.sum() + (k + n).sum()
    )
    # share of time a replica's first stage is busy (a batch holds each stage latency/spp)
    busy = np.asarray(log.latency_s).sum() / spp / (span_s * num_replicas)
    return {
        "mfu": float(flops / (span_s * num_devices * peak_flops)),
        "mbu": float(nbytes / (span_s * num_devices * mem_bw)),
        "busy_fraction": float(min(1.0, busy)),
    }


def latency_summary(rows: list[RequestMetrics]) -> dict:
    """The request-level part of `summary.json`, shared by the simulator and `medha bench`
    (which measures the same quantities from the client side)."""
    done = [m for m in rows if m.e2e_s is not None]
    start = min(m.arrival_s for m in rows)
    span = max((m.arrival_s + m.e2e_s for m in done), default=start) - start
    return {
        "requests": {"total": len(rows), "completed": len(done)},
        "ttft_s": pct(m.ttft_s for m in rows),
        "tpot_s": pct(m.tpot_s for m in rows),
        "tbt_s": pct(t for m in rows for t in m.tbt_s),
        "e2e_s": pct(m.e2e_s for m in rows),
        "normalized_e2e_s": pct(m.normalized_e2e_s for m in rows),
        "scheduling_delay_s": pct(m.scheduling_delay_s for m in rows),
        "preemptions": sum(m.preemptions for m in rows),
        "by_class": {
            c: _class_summary([m for m in rows if m.request_class == c]) for c in ("short", "long")
        },
        # priority classes present in the workload (requests without one are NORMAL)
        "by_priority": {
            c: _class_summary([m for m in rows if m.priority == c])
            for c in PRIORITY_CLASSES
            if any(m.priority == c for m in rows)
        },
        "throughput": {
            "requests_per_s": len(done) / span if span > 0 else 0.0,
            "output_tokens_per_s": sum(m.output_len for m in done) / span if span else 0.0,
            "prefill_tokens_per_s": sum(m.prompt_len for m in done) / span if span else 0.0,
        },
        "slo_attainment": float(np.mean([m.slo_met for m in rows])),
        "ttft_attainment": float(np.mean([m.ttft_met for m in rows])),
        "tpot_attainment": float(np.mean([m.tpot_met for m in rows])),
    }


def summarize(
    requests: list[Request],
    log: IterationLog,
    *,
    config: dict,
    long_threshold: int,
    tpot_target_s: float,
    model: ModelSpec,
    dtype_bytes: int,
    num_devices: int,
    num_replicas: int,
    spp: int,
    peak_flops: float,
    mem_bw: float,
    wall_s: float,
    setup_s: float,
) -> tuple[dict, list[RequestMetrics]]:
    rows = [request_metrics(r, long_threshold, tpot_target_s) for r in requests]
    done = [r for r in requests if r.finish_s is not None]
    start = min(r.arrival_s for r in requests)
    span = max((r.finish_s for r in done), default=start) - start
    summary = {"config": config, **latency_summary(rows)}
    summary.update(
        {
            "utilization": utilization(
                log, model, dtype_bytes, span, num_devices, num_replicas, spp, peak_flops, mem_bw
            ),
            "batches": {
                "count": len(log),
                "mean_decodes": float(np.mean(log.num_decodes)) if len(log) else 0.0,
                "mean_prefill_tokens": float(np.mean(log.prefill_tokens)) if len(log) else 0.0,
                "latency_s": pct(log.latency_s),
            },
            "sim": {
                "simulated_s": span,
                "wall_s": wall_s,
                "setup_s": setup_s,
                "requests_per_wall_s": len(requests) / wall_s if wall_s else None,
                "simulated_s_per_wall_s": span / wall_s if wall_s else None,
            },
        }
    )
    return summary, rows


def preemption_summary(stats: list, block_bytes: float) -> dict:
    """Recompute and swap preemptions over every replica's SchedulerStats; bytes are per
    device (each device moves its own shard of a block, `block_bytes`)."""
    total = {
        k: sum(getattr(s, k) for s in stats)
        for k in (
            "preemptions",
            "recomputes",
            "recomputed_tokens",
            "swap_outs",
            "swap_ins",
            "swapped_out_blocks",
            "swapped_in_blocks",
            "swap_time_s",
        )
    }
    total["swapped_out_bytes_per_device"] = total["swapped_out_blocks"] * block_bytes
    total["swapped_in_bytes_per_device"] = total["swapped_in_blocks"] * block_bytes
    return total


def prefix_cache_summary(
    rows: list[RequestMetrics], reusable: dict[str, int], model: ModelSpec, stats: list
) -> dict:
    """Hits of the prefix cache per request class (and all): prompt tokens, the tokens a direct
    count over the request list says earlier prompts hold (`reusable`, see
    prefix_cache.reusable_prefix_tokens), the tokens the cache supplied from the device and
    from the host tier, and the prefill FLOPs the hits saved (matmuls and the causal attention
    of the cached tokens)."""

    def part(sel: list[RequestMetrics]) -> dict:
        prompt = sum(m.prompt_len for m in sel)
        hits = sum(m.cached_tokens for m in sel)
        host = sum(m.host_cached_tokens for m in sel)
        reuse = sum(reusable[m.request_id] for m in sel)
        total = sum(model.prefill_flops(m.prompt_len) for m in sel)
        saved = sum(model.prefill_flops(m.cached_tokens) for m in sel)
        return {
            "count": len(sel),
            "prompt_tokens": prompt,
            "reusable_tokens": reuse,
            "reusable_fraction": reuse / prompt if prompt else None,
            "hit_tokens": hits,
            "hit_rate": hits / prompt if prompt else None,
            "host_hit_tokens": host,
            "device_hit_tokens": hits - host,
            "prefill_tokens_saved": hits,
            "prefill_flops_saved": saved,
            "prefill_flops_saved_fraction": saved / total if total else None,
        }

    out = {"all": part(rows)}
    for c in ("short", "long"):
        out[c] = part([m for m in rows if m.request_class == c])
    out["host_tier_out_blocks"] = sum(s.host_cache_out_blocks for s in stats)
    return out


WALL_CLOCK_KEYS = ("wall_s", "setup_s", "requests_per_wall_s", "simulated_s_per_wall_s")
