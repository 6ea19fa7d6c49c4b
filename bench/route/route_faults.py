"""kill -9 of one replica under load, through a router.

    python bench/route/route_faults.py [--rate 100] [--seconds 20] [--kill-at 10] [--rounds 2]
        [--routers medha,sglang-cache_aware,vllm-router-cache_aware] [--backend stub|medha]
        [--out route_faults.json]

Two replicas behind a router; an open-loop stream of streamed /v1/completions leaves at `--rate`
requests a second for `--seconds`; at `--kill-at` one replica gets SIGKILL. Per request the
client records when it was sent, when its first token and its end came, and how it ended (the
whole stream to `[DONE]`, an error event, an HTTP error, a connection error). Reported:

- **not started**: requests without a token at the kill (sent before it and still waiting, or
  sent after it), and the share of them that succeeded (target >= 99.9%);
- **in flight**: streams that had a token at the kill and were on the killed replica or not,
  and the longest time from the kill to their end (target: each completes or ends with an
  error within 5 s; none hangs: a stream still open 30 s after the last request was sent counts
  as hung);
- **out after**: for medha's router, the time from the kill until its /health counts one
  replica fewer, polled every 20 ms (target <= 2 s).

Backends: `stub` (default): medha/benchmark/stub_backend.py replicas streaming 16 tokens at
`--token-delay-s` (20 ms) each, so thousands of requests pass in a run and 99.9% is measurable
(a replica of SmolLM2 on one of this machine's cores serves about one request a second);
`medha`: two `medha serve` replicas of the embedded model (one core each), at a rate they can
serve, for the real thing at a smaller count. The peers (sglang-router, vllm-router) come from
medha/benchmark/routers.py, skipped with a message where not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from medha.benchmark.harness import add_common_args  # noqa: E402
from medha.benchmark.local_server import alternated, local_server  # noqa: E402
from medha.benchmark.stub_backend import stub_backend  # noqa: E402

OUTPUT_TOKENS = 16


def medha_router(urls: list[str], dispatcher: str):
    def command(port):
        replicas = [a for u in urls for a in ("--replica", u)]
        return [sys.executable, "-m", "medha", "route", "--port", str(port), *replicas,
                "--dispatcher", dispatcher, "--log-level", "warning"]  # fmt: skip

    return local_server(command, startup_s=120)


@contextmanager
def peer_router(name: str, urls: list[str]):
    from medha.benchmark.routers import check_installed, running_router

    check_installed(name)
    with running_router(name, urls) as (url, _, _):
        yield url


async def one(session, url: str, model: str, record: dict) -> None:
    # a prompt of its own: a cache-aware router would send one repeated prompt to one replica
    prompt = f"Tell me story number {random.randrange(10**9)} about a router."
    # ignore_eos (vLLM's extension, medha serve's too): the embedded model ends this prompt
    # after a token or two, and a stream must be long enough to be cut by the kill
    body = {"model": model, "prompt": prompt, "stream": True, "ignore_eos": True,
            "max_tokens": OUTPUT_TOKENS, "temperature": 0}  # fmt: skip
    record["sent"] = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                record["end"], record["outcome"] = time.monotonic(), f"http {resp.status}"
                await resp.read()
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                if "first" not in record and b'"text"' in chunk:
                    record["first"] = time.monotonic()
                buf += chunk
            record["end"] = time.monotonic()
            if b'"error"' in buf:
                record["outcome"] = "error event"
            elif buf.rstrip().endswith(b"data: [DONE]"):
                record["outcome"] = "ok"
            else:
                record["outcome"] = "truncated"
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        record["end"], record["outcome"] = time.monotonic(), f"connection: {type(e).__name__}"


async def drive(url, model, rate, seconds, kill_at, kill, health_url) -> tuple[list, float, float]:
    records: list[dict] = []
    tasks = []
    out_after = float("nan")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()
        killed_at = None
        due = start
        n = int(rate * seconds)
        for _ in range(n):
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if killed_at is None and time.monotonic() - start >= kill_at:
                killed_at = time.monotonic()
                kill()
                if health_url:
                    tasks.append(asyncio.create_task(_watch_out(session, health_url, killed_at)))
            record: dict = {}
            records.append(record)
            tasks.append(asyncio.create_task(one(session, url, model, record)))
            due += 1.0 / rate
        watch = [t for t in tasks if t.get_coro().__name__ == "_watch_out"]
        streams = [t for t in tasks if t not in watch]
        _, hung = await asyncio.wait(streams, timeout=30)
        for t in hung:
            t.cancel()
        if watch:
            out_after = await watch[0]
    return records, killed_at, out_after


async def _watch_out(session, health_url: str, killed_at: float) -> float:
    while time.monotonic() - killed_at < 30:
        try:
            async with session.get(health_url) as r:
                body = await r.json()
            if body.get("healthy_replicas") == body.get("replicas", 2) - 1:
                return time.monotonic() - killed_at
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(0.02)
    return float("inf")


def summarize(records: list[dict], killed_at: float) -> dict:
    not_started = [r for r in records if "first" not in r or r["first"] >= killed_at]
    in_flight = [r for r in records if "first" in r and r["first"] < killed_at
                 and r.get("end", float("inf")) >= killed_at]  # fmt: skip
    ok = sum(r.get("outcome") == "ok" for r in not_started)
    ends = [r.get("end", float("inf")) - killed_at for r in in_flight]
    outcomes: dict[str, int] = {}
    for r in records:
        o = r.get("outcome", "hung")
        outcomes[o] = outcomes.get(o, 0) + 1
    return {
        "requests": len(records),
        "not_started": len(not_started),
        "not_started_ok": ok,
        "not_started_ok_share": ok / max(1, len(not_started)),
        "in_flight": len(in_flight),
        "in_flight_ended_with_error": sum(r.get("outcome") != "ok" for r in in_flight),
        "in_flight_longest_end_after_kill_s": max(ends, default=0.0),
        "outcomes": outcomes,
    }


def replicas(
    stack: ExitStack, backend: str, token_delay_s: float, count: int = 2
) -> list[tuple[str, object]]:
    if backend == "stub":
        return [
            stack.enter_context(
                stub_backend(with_process=True, n_tokens=OUTPUT_TOKENS, token_delay_s=token_delay_s)
            )
            for _ in range(count)
        ]

    def command(core):
        return lambda port: ["taskset", "-c", str(core), sys.executable, "-m", "medha", "serve",
                             "--port", str(port), "--prefix-cache", "device",
                             "--log-level", "warning"]  # fmt: skip

    return [
        stack.enter_context(
            local_server(command(i % os.cpu_count()), quiet=True, with_process=True)
        )
        for i in range(count)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--kill-at", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--routers", default="medha")
    ap.add_argument("--dispatcher", default="slack")
    ap.add_argument("--backend", choices=("stub", "medha"), default="stub")
    ap.add_argument("--token-delay-s", type=float, default=0.02)
    add_common_args(ap, out=None)
    args = ap.parse_args()
    results = []
    for rnd, name in alternated(args.routers.split(","), args.rounds):
        with ExitStack() as stack:
            reps = replicas(stack, args.backend, args.token_delay_s)
            urls = [u for u, _ in reps]
            model = json.loads(__import__("httpx").get(urls[0] + "/v1/models").text)["data"][0][
                "id"
            ]
            try:
                router = stack.enter_context(
                    medha_router(urls, args.dispatcher)
                    if name == "medha"
                    else peer_router(name, urls)
                )
            except Exception as e:  # noqa: BLE001 - a missing peer is skipped, said so
                print(f"{name}: skipped: {e}")
                continue
            victim = reps[1][1]
            kill = lambda victim=victim: victim.send_signal(signal.SIGKILL)  # noqa: E731
            health = router + "/health" if name == "medha" else None
            records, killed_at, out_after = asyncio.run(
                drive(
                    router,
                    model,
                    args.rate,
                    args.seconds,
                    args.kill_at,
                    kill,
                    health,
                )
            )
            s = {"router": name, "round": rnd, **summarize(records, killed_at),
                 "out_after_s": out_after}  # fmt: skip
            results.append(s)
            print(
                f"{name} round {rnd}: not started {s['not_started_ok']}/{s['not_started']} ok "
                f"({s['not_started_ok_share']:.2%}), in flight {s['in_flight']} "
                f"({s['in_flight_ended_with_error']} ended with an error), last in-flight end "
                f"{s['in_flight_longest_end_after_kill_s']:.2f} s after the kill, out after "
                f"{out_after:.2f} s; outcomes {s['outcomes']}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
