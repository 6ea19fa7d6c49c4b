"""Sending and timing the requests of `medha bench` (the package's docstring says what it
measures); the results go to summary.json, requests.csv and CDF plots."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from medha.benchmark.config import BenchConfig
from medha.benchmark.route_workloads import words
from medha.benchmark.workload import BenchRequest, build_requests
from medha.core.config import LONG_THRESHOLD_CAP, default_long_threshold
from medha.sim.metrics.plots import latency_cdfs
from medha.sim.metrics.summary import RequestMetrics, latency_summary


@dataclass
class _Result:
    req: BenchRequest
    status: str = "ok"
    error: str = ""
    send_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each non-empty text chunk
    end_s: float | None = None
    completion_tokens: int | None = None


class BenchError(Exception):
    """The server cannot be benchmarked (unreachable, refuses the model, ...)."""


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _prompt(req: BenchRequest, seed: int, as_tokens: bool):
    rng = random.Random(seed * 1_000_003 + req.index)
    if as_tokens:
        # ids far from the special tokens at the start of most vocabularies
        return [rng.randrange(1000, 30000) for _ in range(req.prompt_len)]
    return words(rng, req.prompt_len)


def _body(cfg: BenchConfig, model: str, req: BenchRequest) -> dict:
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.send_slo:
        ttft = round(cfg.ttft_target_s(req.prompt_len), 4)
        body["medha"] = {"ttft_slo_s": ttft}
        if cfg.send_tpot_slo:
            body["medha"]["tpot_slo_s"] = cfg.tpot_slo_s
    if cfg.send_priority:
        body["priority"] = req.prompt_len
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": _prompt(req, cfg.seed, False)}]
    else:  # (text: words that SmolLM2 tokenizes one token each, for a front that takes no ids)
        body["prompt"] = _prompt(req, cfg.seed, cfg.endpoint == "completions")
    return body


async def _send(client: httpx.AsyncClient, url: str, body: dict, res: _Result) -> None:
    res.send_s = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                res.status, res.error = "error", f"HTTP {resp.status_code}: {text}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.status, res.error = "error", event["error"].get("message", data)
                    return
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        res.chunk_s.append(time.perf_counter())
                if event.get("usage"):
                    res.completion_tokens = event["usage"]["completion_tokens"]
        res.end_s = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.status, res.error = "error", f"{type(e).__name__}: {e}"


def long_threshold(cfg: BenchConfig, card: dict) -> tuple[int, str]:
    """The prompt length from which a request counts as long, and where it came from: the
    flag; else the scheduler's default for the max_model_len of the server's model card
    (medha and vLLM report it in /v1/models), so that the classes match the requests the
    server itself treats as long; else that default for an unknown context (32768)."""
    if cfg.long_threshold is not None:
        return cfg.long_threshold, "flag"
    max_len = card.get("max_model_len")
    if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > 0:
        return default_long_threshold(max_len), "server max_model_len"
    return LONG_THRESHOLD_CAP, "default"


def _metrics(res: _Result, cfg: BenchConfig, t0: float, threshold: int) -> RequestMetrics:
    ok = res.status == "ok" and bool(res.chunk_s) and res.end_s is not None
    ttft = res.chunk_s[0] - res.send_s if ok else None
    e2e = res.end_s - res.send_s if ok else None
    n = res.completion_tokens or len(res.chunk_s)
    tpot = (res.chunk_s[-1] - res.chunk_s[0]) / (n - 1) if ok and n > 1 else None
    target = cfg.ttft_target_s(res.req.prompt_len)
    return RequestMetrics(
        request_id=str(res.req.index),
        request_class="long" if res.req.prompt_len >= threshold else "short",
        arrival_s=res.send_s - t0,
        prompt_len=res.req.prompt_len,
        output_len=n if ok else 0,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        normalized_e2e_s=e2e / n if ok and n else None,
        scheduling_delay_s=None,
        ttft_deadline_s=target,
        ttft_met=ttft is not None and ttft <= target,
        tpot_met=ok and (tpot is None or tpot <= cfg.tpot_slo_s),
        preemptions=0,
        tbt_s=[b - a for a, b in zip(res.chunk_s, res.chunk_s[1:])] if ok else [],
    )


async def _server_counter(client: httpx.AsyncClient, base: str, name: str) -> float | None:
    """A counter from the server's Prometheus /metrics, if it is a medha server."""
    try:
        text = (await client.get(base.removesuffix("/v1") + "/metrics")).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def _run(cfg: BenchConfig, requests: list[BenchRequest], progress: bool) -> tuple:
    base = _base(cfg.url)
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("MEDHA_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(headers=headers, timeout=cfg.timeout_s, limits=limits) as c:
        try:
            resp = await c.get(base + "/models")
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach {base}/models: {e}") from None
        if resp.status_code != 200:
            raise BenchError(f"{base}/models answered HTTP {resp.status_code}: {resp.text[:200]}")
        cards = resp.json()["data"]
        model = cfg.model or cards[0]["id"]
        card = next((c for c in cards if c.get("id") == model), {})
        threshold = long_threshold(cfg, card)
        preempt0 = await _server_counter(c, base, "medha_preemptions")
        url = base + ("/chat/completions" if cfg.endpoint == "chat" else "/completions")
        results = [_Result(r) for r in requests]
        bar = tqdm(total=len(requests), unit="req", disable=not progress)
        t0 = time.perf_counter()

        async def one(res: _Result) -> None:
            await asyncio.sleep(max(0.0, t0 + res.req.arrival_s - time.perf_counter()))
            await _send(c, url, _body(cfg, model, res.req), res)
            bar.update(1)
            if res.status != "ok":
                bar.set_postfix(errors=sum(r.status != "ok" for r in results))

        await asyncio.gather(*(one(r) for r in results))
        wall = time.perf_counter() - t0
        bar.close()
        preempt1 = await _server_counter(c, base, "medha_preemptions")
    preemptions = preempt1 - preempt0 if preempt0 is not None and preempt1 is not None else None
    return model, threshold, results, t0, wall, preemptions


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    requests = build_requests(
        trace=cfg.trace,
        workload=cfg.workload,
        qps=cfg.qps,
        num_requests=cfg.num_requests,
        seed=cfg.seed,
    )
    model, (threshold, source), results, t0, wall, preemptions = asyncio.run(
        _run(cfg, requests, progress)
    )
    rows = [_metrics(r, cfg, t0, threshold) for r in results]
    summary = {
        "config": {
            "bench": asdict(cfg) | {"api_key": None},
            "model": model,
            "url": _base(cfg.url),
            "long_threshold": threshold,
            "long_threshold_from": source,
        },
        **latency_summary(rows),
        "utilization": None,
        "batches": None,
        "sim": None,
        "client": {
            "wall_s": wall,
            "errors": sum(r.status != "ok" for r in results),
            "server_preemptions": preemptions,
        },
    }
    if preemptions is not None:
        summary["preemptions"] = int(preemptions)
    _write(Path(cfg.out), summary, rows, results)
    return summary


def _write(out: Path, summary: dict, rows: list[RequestMetrics], results: list[_Result]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "requests.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        # the first three columns make the file a Vidur-style trace: `medha simulate --trace`
        # and `medha bench --trace` replay exactly this run
        w.writerow(
            [
                "arrived_at",
                "num_prefill_tokens",
                "num_decode_tokens",
                "request_class",
                "status",
                "ttft_s",
                "tpot_s",
                "e2e_s",
                "completion_tokens",
                "error",
            ]
        )
        for m, r in zip(rows, results):
            w.writerow(
                [
                    f"{r.req.arrival_s:.6f}",
                    r.req.prompt_len,
                    r.req.output_len,
                    m.request_class,
                    r.status,
                    m.ttft_s,
                    m.tpot_s,
                    m.e2e_s,
                    r.completion_tokens,
                    r.error,
                ]
            )
    latency_cdfs(out, rows)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")  # written last: its presence means the run completed
