"""bench/route/route_slo.py's calibration: the time to first token of prompts alone on one fresh
replica (one core, as in the runs), fitted with non-negative a + b L + c L^2, and how many
tokens the chat template adds; the TTFT targets (medha/benchmark/route_client.Slo) follow it.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import numpy as np
from scipy.optimize import nnls

from medha.benchmark.route_client import Result, send
from medha.benchmark.route_probes import served_model
from medha.benchmark.route_workloads import words
from medha.benchmark.routers import serving_replicas

CALIBRATION_LENGTHS = (16, 128, 512, 1024, 2048)


def ttft_alone(url: str, model: str, body: dict, endpoint: str) -> tuple[float, int]:
    res = Result("calibration", 0, None, 0.0, 0)
    body = {"model": model, "max_tokens": 1, "stream": True, "temperature": 0} | body
    body["stream_options"] = {"include_usage": True}

    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            await send(client, f"{url}/v1/{endpoint}", body, {}, res, time.perf_counter())

    asyncio.run(go())
    if res.status != "ok":
        raise RuntimeError(f"calibration request failed: {res.error}")
    return res.ttft_s, res.prompt_tokens


def calibrate(args, log) -> dict:
    """Time to first token of prompts alone on one fresh replica (one core), fitted with
    non-negative a + b L + c L^2; and how many tokens the chat template adds."""
    rng = random.Random(args.seed + 3)
    flags = ["--prefix-cache", "device", *args.replica_flags.split()]
    with serving_replicas(1, flags, pin=not args.no_pin, log=log) as (url,):
        model = served_model(url)
        ttft_alone(url, model, {"prompt": words(rng, 64)}, "completions")  # warm-up
        points = []
        for n in CALIBRATION_LENGTHS:
            ttft, tokens = ttft_alone(url, model, {"prompt": words(rng, n)}, "completions")
            points.append((tokens, ttft, n))
        _, one = ttft_alone(
            url,
            model,
            {"messages": [{"role": "user", "content": words(rng, 8)}]},
            "chat/completions",
        )
        _, two = ttft_alone(
            url,
            model,
            {
                "messages": [
                    {"role": "system", "content": words(rng, 8)},
                    {"role": "user", "content": words(rng, 8)},
                ]
            },
            "chat/completions",
        )
    lengths = np.array([p[0] for p in points], dtype=float)
    times = np.array([p[1] for p in points])
    basis = np.stack([np.ones_like(lengths), lengths, lengths**2], axis=1)
    fit, _ = nnls(basis, times)
    per_message = max(0, round((two - 16 - 3) / 2))
    return {
        "points": [{"words": n, "tokens": t, "ttft_s": s} for t, s, n in points],
        "tokens_per_word": float(np.mean([p[0] / p[2] for p in points])),
        "fit": [float(x) for x in fit],
        "chat": {
            "per_message": per_message,
            "default_system": max(0, one - 8 - 3 - per_message),
        },
    }
