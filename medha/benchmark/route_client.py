"""bench/route/route_slo.py's client: each request streamed to /v1/completions or
/v1/chat/completions with its TTFT target (`Slo`) in the body and a header, timed chunk by
chunk (`send`), and a whole workload sent at its arrival times (`run_workload`: one-shots open
loop, each conversation closed-loop with the answers it got).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from medha.benchmark.route_workloads import Conversation, OneShot


@dataclass
class Result:
    workload: str
    index: int  # request (one-shot) or conversation
    turn: int | None
    target_s: float
    est_prompt_tokens: int
    sent_s: float = 0.0
    status: str = "ok"
    error: str = ""
    ttft_s: float | None = None
    # the router's own prediction of it (medha route's slack dispatcher sends it in the header
    # x-medha-predicted-ttft-ms; None for the other routers)
    predicted_ttft_s: float | None = None
    replica: str | None = None  # which replica answered (medha route's x-medha-replica)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = field(default="", repr=False)
    payload: object = field(default=None, repr=False)  # the prompt or messages (the twin's)


class Slo:
    """The TTFT target of a prompt of L tokens: max(1.5 x isolated TTFT(L), 0.5 s), isolated
    TTFT = a + b L + c L^2 from the calibration; or one fixed target."""

    def __init__(self, calibration: dict | None, fixed_s: float | None) -> None:
        self.calibration, self.fixed_s = calibration, fixed_s

    def target(self, tokens: int) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        a, b, c = self.calibration["fit"]
        return max(1.5 * (a + b * tokens + c * tokens**2), 0.5)


async def send(client, url: str, body: dict, headers: dict, res: Result, t0: float) -> None:
    """POST `body` to `url` streamed, filling `res`: when it left (against `t0`), its first
    text's time, the end, the usage the server reported, what the router said in its headers;
    a failure is res.status "error" with its reason."""
    res.sent_s = time.perf_counter() - t0
    start = time.perf_counter()
    chunks = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                res.status, res.error = "error", f"HTTP {resp.status_code}: {text}"
                return
            predicted = resp.headers.get("x-medha-predicted-ttft-ms")
            if predicted is not None:
                res.predicted_ttft_s = float(predicted) / 1000
            res.replica = resp.headers.get("x-medha-replica")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.status, res.error = "error", str(event["error"].get("message"))[:300]
                    return
                for choice in event.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        if res.ttft_s is None:
                            res.ttft_s = time.perf_counter() - start
                        chunks.append(piece)
                if usage := event.get("usage"):
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
        res.e2e_s = time.perf_counter() - start
        res.text = "".join(chunks)
        if res.ttft_s is None:
            res.status, res.error = "error", "no text"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.status, res.error = "error", f"{type(e).__name__}: {e}"


def request_body(model: str, max_tokens: int, target_s: float) -> dict:
    """A streamed request for exactly `max_tokens`, greedy, carrying its TTFT target."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "medha": {"ttft_slo_s": round(target_s, 4)},
    }


def slo_header(target_s: float) -> dict:
    """The TTFT target as a header, for a router that reads it."""
    return {"x-slo-ttft-ms": str(round(target_s * 1000))}


async def run_workload(base: str, model: str, workload, slo: Slo, chat_overhead: dict) -> tuple:
    """Send `workload` (one-shots or conversations) to `base`; (results, wall seconds)."""
    results: list[Result] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()

        async def one_shot(r: OneShot) -> None:
            target = slo.target(r.prompt_tokens)
            res = Result("oneshot", r.index, None, target, r.prompt_tokens)
            results.append(res)
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            body = request_body(model, r.max_tokens, target) | {"prompt": r.prompt}
            res.payload = r.prompt
            await send(client, base + "/v1/completions", body, slo_header(target), res, t0)

        async def conversation(c: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + c.start_s - time.perf_counter()))
            messages = [{"role": "system", "content": c.system}] if c.system else []
            tokens = c.system_tokens + (0 if c.system else chat_overhead["default_system"])
            for k, turn in enumerate(c.turns):
                messages.append({"role": "user", "content": turn.user})
                tokens += turn.user_tokens
                est = tokens + chat_overhead["per_message"] * len(messages) + 3
                target = slo.target(est)
                res = Result("conversation", c.index, k, target, est)
                results.append(res)
                headers = slo_header(target) | {"x-session-id": f"conversation-{c.index}"}
                body = request_body(model, turn.max_tokens, target) | {"messages": list(messages)}
                res.payload = list(messages)
                await send(client, base + "/v1/chat/completions", body, headers, res, t0)
                if res.status != "ok":
                    # later turns would need this answer: they count as failed, unsent
                    for j in range(k + 1, len(c.turns)):
                        results.append(
                            Result("conversation", c.index, j, 0.0, 0, status="not sent")
                        )
                    return
                messages.append({"role": "assistant", "content": res.text})
                tokens += res.completion_tokens or turn.max_tokens
                await asyncio.sleep(turn.think_s)

        tasks = [conversation(w) if isinstance(w, Conversation) else one_shot(w) for w in workload]
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0
