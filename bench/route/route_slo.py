"""Routers in front of two `medha serve` replicas: TTFT SLO attainment, prefix hits, hot spots.

    python bench/route_slo.py [--contenders all]
        [--workloads multi_turn,shared_prefix,mixed,sharegpt] [--rounds 1] [--qps 0.5]
        [--num-requests 20] [--install-peers] [--out runs/route_slo]

Contenders (medha/benchmark/routers.py): `medha route` with each dispatcher (medha-slack,
medha-round_robin, medha-least_work, medha-prefix, medha-pla), SGLang's router with
cache_aware, vLLM's router with cache_aware and with consistent_hash. A peer that is not
installed is reported as "skipped: <why>" (--install-peers installs both into their own
virtual environment first). One contender runs at a time, in the order
`local_server.alternated` gives (flipped every round: a 2-core machine drifts over minutes),
and every (round, contender, workload) gets two freshly started replicas, `medha serve
--prefix-cache device` bound to one core each (taskset -c 0, -c 1), and a fresh router: every
contender starts with empty prefix caches, zeroed counters and an empty routing state.

Workloads, all real text through the OpenAI API, streamed:

- multi_turn: conversations as `medha trace generate` builds them (ConversationTraceConfig:
  a few system prompts shared by most conversations, geometric turn counts, log-normal user
  messages, answers and think times), sized for SmolLM2 on one core per replica (--multi-turn
  changes any field). Each turn goes to /v1/chat/completions with the whole history: the
  system prompt, every earlier user message and the answer the server actually gave, then the
  new message; so prompts share the system prompt's text across conversations and the
  conversation's own history across turns, which is what a prefix-aware router can exploit.
  Conversations start at Poisson times (rate --qps / mean turns, so about --qps requests a
  second) and each runs closed-loop: the next turn leaves a think time after the previous
  answer ended. Replaying the trace's timestamps open-loop would not be faithful here: its
  turn times assume 30 ms a token, and a turn sent before the previous answer has arrived
  could not contain it. Every turn carries X-Session-ID: its conversation (the key
  vllm-router's consistent_hash is documented to take; the others ignore it).
- shared_prefix: questions about documents (SHARED_PREFIX: 8 documents of 512 tokens, Zipf
  popularity with exponent 1, so the first draws 37% of the requests; questions of 16-64
  tokens, 16-48 output tokens), Poisson at --qps, to /v1/completions. The trace is medha's own
  (a document-QA service): the hot document is what pulls a cache-aware router onto one
  replica.
- mixed: bench/server_mixed_load.py's mix (95% prompts of 32-256 tokens, 5% of 3,000-6,000,
  16-48 output tokens), Poisson at --qps, lengths and arrival times from `medha bench`'s
  build_requests, random words to /v1/completions.
- sharegpt: the control with little sharing: lengths from the bundled ShareGPT trace (Llama-2
  tokenizer counts), prompts clipped to --sharegpt-max-prompt and outputs to
  --sharegpt-max-output tokens (its median prompt of 1,730 tokens and answer of 415 would
  take ~8 s and ~25 s on one of these cores: the clipped mix keeps the replicas below
  saturation at the smoke rate), Poisson at --qps, random words to /v1/completions.

Every request asks for exactly its output length (ignore_eos, temperature 0). Prompts are
words that SmolLM2 tokenizes one token each (the calibration checks it), so the client knows a
prompt's length before sending it.

The TTFT target of each request is medha's default deadline, max(1.5 x its isolated prefill
time, 0.5 s), the one a medha replica gives a request that names none; here "isolated prefill
time" is measured, not predicted: before the first contender, one replica (one core, as in the
runs) answers prompts of 16 to 2,048 tokens alone, and the time to first token through HTTP is
fitted with a + b L + c L^2 (non-negative terms) over the prompt length L (the whole prompt:
the target does not shrink with a cache hit, so a router that lands a turn on the replica
holding its history meets the target with room to spare, and one that does not pays the full
prefill). The measured time is what a client sees of a lone request on this machine; medha's
own profile was taken on both cores and would make every target ~2x too tight for one core.
--ttft-slo-s sets one fixed target instead. Each request carries its target as
`medha: {"ttft_slo_s": ...}` in the body (the replica's deadline; SGLang's router drops it on
chat requests, see routers.py, and the replica then applies its default, the same formula
over its own prediction) and as the header x-slo-ttft-ms (for a router that reads it).

Reported per contender and workload (pooled over rounds): short-request TTFT p50/p99 (prompt
below 1,024 tokens, server_mixed_load's long threshold), SLO attainment (share of requests
with a first token within target; failures count as misses) and misses, the cluster's prefix
hit rate (prefix_cache_hits_tokens over prefix_cache_queries_tokens, both replicas' /metrics,
read before and after the run), the hot-spot index (replicas x the busiest replica's share of
the requests, from each replica's medha_requests_total; 1.0 is perfectly even, 2.0 all on
one; and the same over the prefill work, the prompt tokens each replica's cache missed: a
router that keeps long conversations on one replica and sends the many short ones to the
other is even by work and not by count), the router's CPU time a request (on this machine
taken from the replicas' cores), throughput (completed requests and output tokens a second of
wall time), the three slowest short requests (what they met: cached tokens, requests in flight
at their send) and the short p99 no router can beat on the run (each cell's first request,
sent to idle replicas with empty caches, at its isolated TTFT). The JSON at
--out/summary.json holds every round, every request and the calibration; --report PATH prints
a stored run's tables again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from scipy.optimize import nnls

from medha.benchmark.local_server import alternated
from medha.benchmark.routers import (
    CONTENDERS,
    Missing,
    check_installed,
    contender,
    cpu_seconds,
    install_peers,
    running_router,
    serving_replicas,
)
from medha.benchmark.workload import build_requests
from medha.sim.workload.prefix_trace import ConversationTraceConfig

WORKLOADS = ("multi_turn", "shared_prefix", "mixed", "sharegpt")
MIXED = "prompt=32-256,output=16-48,long_fraction=0.05,long_prompt=3000-6000"
SHAREGPT = Path(__file__).resolve().parents[1] / (
    "medha/data/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
)
LONG_THRESHOLD = 1024
# ConversationTraceConfig's defaults describe GPU-scale chats (2,000-token system prompts,
# 300-token messages, 250-token answers); one core of this CPU prefills ~250 tokens a second
MULTI_TURN = dict(
    system_prompts=4,
    system_prompt_share=0.8,
    system_prompt_tokens=512,
    mean_turns=4.0,
    user_tokens=48,
    output_tokens=32,
    think_s=3.0,
    max_context=2048,
)
# documents asked about, most often the first few: each request is one of them and a question
SHARED_PREFIX = dict(
    documents=8,
    document_tokens=512,
    zipf=1.0,
    question_tokens=(16, 64),
    output_tokens=(16, 48),
)
# single tokens for SmolLM2 with their leading space
WORDS = (
    "the cat sat on a mat and we ran to see it go by while you read this line of text "
    "about time space light sound water fire earth wind rain snow day night sun moon "
    "star tree leaf root seed bird fish road city town house door room wall"
).split()
CALIBRATION_LENGTHS = (16, 128, 512, 1024, 2048)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# --- workloads -------------------------------------------------------------------------------


@dataclass
class Turn:
    user: str
    user_tokens: int
    max_tokens: int
    think_s: float  # after this turn's answer, before the next turn


@dataclass
class Conversation:
    index: int
    start_s: float
    system: str | None
    system_tokens: int
    turns: list[Turn]


@dataclass
class OneShot:
    index: int
    arrival_s: float
    prompt: str
    prompt_tokens: int
    max_tokens: int


def conversations(cfg: ConversationTraceConfig, num_requests: int, qps: float, seed: int):
    """`cfg`'s conversations, sampled as generate_conversations samples them (the same
    distributions), with text, until `num_requests` turns; Poisson starts at qps / mean_turns."""
    rng = random.Random(seed)
    text = random.Random(seed + 1)
    systems = [words(text, cfg.system_prompt_tokens) for _ in range(cfg.system_prompts)]
    out, total, start = [], 0, 0.0

    def lognormal(median: float, sigma: float) -> int:
        return max(1, int(rng.lognormvariate(math.log(median), sigma)))

    while total < num_requests:
        start += rng.expovariate(qps / cfg.mean_turns)
        system = None
        if cfg.system_prompts and rng.random() < cfg.system_prompt_share:
            system = rng.randrange(cfg.system_prompts)
        history = cfg.system_prompt_tokens if system is not None else 0
        n = 1
        if cfg.mean_turns > 1:
            n += int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / cfg.mean_turns))
        turns = []
        for _ in range(min(n, num_requests - total)):
            user, answer = lognormal(cfg.user_tokens, 1.0), lognormal(cfg.output_tokens, 0.7)
            if history + user + answer > cfg.max_context:
                break
            think = rng.lognormvariate(math.log(cfg.think_s), 1.0)
            turns.append(Turn(words(text, user), user, answer, think))
            history += user + answer
        if turns:
            out.append(
                Conversation(
                    len(out),
                    start,
                    systems[system] if system is not None else None,
                    cfg.system_prompt_tokens if system is not None else 0,
                    turns,
                )
            )
            total += len(turns)
    return out


def shared_prefix(cfg: dict, num_requests: int, qps: float, seed: int) -> list[OneShot]:
    """Questions about a few documents: each prompt is one of `documents` texts of
    `document_tokens` words, drawn with Zipf weights 1 / rank^`zipf` (the first is the hot
    one), then a question of uniform length; Poisson arrivals at `qps`. Every request shares
    its whole document with the others about it, so a router gains by keeping a document on
    a replica that holds it, and loses when the hot document's replica is swamped."""
    rng, text = random.Random(seed), random.Random(seed + 1)
    docs = [words(text, cfg["document_tokens"]) for _ in range(cfg["documents"])]
    weights = [1.0 / (k + 1) ** cfg["zipf"] for k in range(cfg["documents"])]
    out, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(qps)
        d = rng.choices(range(cfg["documents"]), weights)[0]
        q = rng.randint(*cfg["question_tokens"])
        prompt = f"{docs[d]} {words(text, q)}"
        out.append(
            OneShot(i, t, prompt, cfg["document_tokens"] + q, rng.randint(*cfg["output_tokens"]))
        )
    return out


def one_shots(name: str, args) -> list[OneShot]:
    if name == "shared_prefix":
        return shared_prefix(SHARED_PREFIX, args.num_requests, args.qps, args.seed)
    if name == "mixed":
        reqs = build_requests(
            trace=None, workload=MIXED, qps=args.qps, num_requests=args.num_requests, seed=args.seed
        )
    else:
        reqs = build_requests(
            trace=str(SHAREGPT),
            workload=None,
            qps=args.qps,
            num_requests=args.num_requests,
            seed=args.seed,
        )
        reqs = [
            replace(
                r,
                prompt_len=min(r.prompt_len, args.sharegpt_max_prompt),
                output_len=min(r.output_len, args.sharegpt_max_output),
            )
            for r in reqs
        ]
    text = random.Random(args.seed + 2)
    return [
        OneShot(r.index, r.arrival_s, words(text, r.prompt_len), r.prompt_len, r.output_len)
        for r in reqs
    ]


# --- sending ---------------------------------------------------------------------------------


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


async def _send(client, url: str, body: dict, headers: dict, res: Result, t0: float) -> None:
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


def _body(model: str, max_tokens: int, target_s: float) -> dict:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "medha": {"ttft_slo_s": round(target_s, 4)},
    }


def _slo_header(target_s: float) -> dict:
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
            body = _body(model, r.max_tokens, target) | {"prompt": r.prompt}
            res.payload = r.prompt
            await _send(client, base + "/v1/completions", body, _slo_header(target), res, t0)

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
                headers = _slo_header(target) | {"x-session-id": f"conversation-{c.index}"}
                body = _body(model, turn.max_tokens, target) | {"messages": list(messages)}
                res.payload = list(messages)
                await _send(client, base + "/v1/chat/completions", body, headers, res, t0)
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


# --- replicas' counters ----------------------------------------------------------------------


def samples(url: str) -> list:
    """The samples of a server's /metrics (name, labels, value), by prometheus_client's parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def replica_counters(url: str) -> dict:
    out = {"requests": 0.0, "prefix_queries": 0.0, "prefix_hits": 0.0}
    names = {
        "medha_prefix_cache_queries_tokens": "prefix_queries",
        "medha_prefix_cache_hits_tokens": "prefix_hits",
    }
    for sample in samples(url):
        if sample.name == "medha_requests_total":
            out["requests"] += sample.value
        elif sample.name in names:
            out[names[sample.name]] = sample.value
    return out


def router_measures(base: str) -> dict:
    """What `medha route` measured: each replica's speed, its median prediction error, the
    picks that error changed."""
    slowdowns, out = {}, {}
    for sample in samples(base):
        if sample.name == "medha_router_replica_slowdown":
            slowdowns[sample.labels["replica"]] = sample.value
        elif sample.name == "medha_router_prediction_error_seconds":
            out["prediction_error_s"] = sample.value
        elif sample.name == "medha_router_tie_breaks_total":
            out["tie_breaks"] = int(sample.value)
    return out | {"slowdowns": [slowdowns[k] for k in sorted(slowdowns, key=int)] or None}


def replica_kv_tokens(url: str) -> int:
    for sample in samples(url):
        if sample.name == "medha_kv_capacity_tokens":
            return int(sample.value)
    raise RuntimeError(f"{url}/metrics has no medha_kv_capacity_tokens")


# --- the digital twin and the one-cache reference ---------------------------------------------

_TOKENIZER = None


def _tokens(payload) -> list[int]:
    """The token ids a medha replica computes for a request's prompt or messages (its own
    tokenizer and chat template)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from medha.engine.tokenizer import Tokenizer
        from medha.perf.hardware_specs import cache_dir

        _TOKENIZER = Tokenizer(cache_dir() / "models" / "smollm2-135m-instruct")
    if isinstance(payload, str):
        return _TOKENIZER.encode(payload)
    return _TOKENIZER.apply_chat_template(payload)


def twin_trace(results: list) -> list[dict]:
    """The run's requests as a JSONL trace (Mooncake's fields plus token_ids): sent times,
    prompt tokens, output lengths, for `medha simulate` to replay."""
    rows = []
    for r in sorted((r for r in results if r.payload is not None), key=lambda r: r.sent_s):
        ids = _tokens(r.payload)
        out = r.completion_tokens or 1
        rows.append(
            {"timestamp": round(r.sent_s * 1e3, 3), "input_length": len(ids),
             "output_length": out, "token_ids": ids, "ok": r.status == "ok",
             "ttft_s": r.ttft_s}
        )  # fmt: skip
    return rows


def one_cache_hit_rate(rows: list[dict], capacity_tokens: int, block: int = 16) -> float | None:
    """The prefix hit rate of one cache holding both replicas' (an LRU of `capacity_tokens`,
    16-token chained block keys, every earlier prompt in it): the reference a router's
    cluster hit rate is held to."""
    from medha.core.request import Request
    from medha.route.tracked import PrefixIndex
    from medha.scheduler.prefix_cache import cacheable_pages

    index = PrefixIndex(capacity_tokens // block)
    hits = total = 0
    for i, row in enumerate(rows):
        r = Request.from_tokens(f"r{i}", 0.0, row["token_ids"], row["output_length"])
        keys, per, limit = cacheable_pages(r, block)
        hits += index.match(keys, limit) * per * block
        total += r.prompt_len
        index.add(keys)
    return hits / total if total else None


def simulate_twin(cell: dict, profile: str) -> float | None:
    """`medha simulate` of the cell's requests on two replicas under the contender's
    dispatcher and the replicas' profile: its short-request TTFT p50."""
    dispatcher = cell["contender"].removeprefix("medha-")
    trace = Path(cell["twin_trace"])
    sim_out = trace.with_suffix("")
    subprocess.run(
        [sys.executable, "-m", "medha", "simulate", "--model", "smollm2-135m", "--hardware",
         "cpu", "--predictor", f"profiled:{profile}", "--trace", str(trace), "--replicas", "2",
         "--dispatcher", dispatcher, "--prefix-cache", "device", "--kv-memory-gb", "2",
         "--long-threshold", str(LONG_THRESHOLD), "--out", str(sim_out), "--no-plots",
         "--overwrite"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    summary = json.loads((sim_out / "summary.json").read_text())
    return summary["by_class"]["short"]["ttft_s"]["p50"]


def served_model(replica: str) -> str:
    """The replica's model name: what clients must send (SGLang's router lists "unknown")."""
    return httpx.get(replica + "/v1/models", timeout=10).json()["data"][0]["id"]


def slo_field_forwarded(base: str, model: str) -> dict:
    """Whether the router passes the body's `medha` object on to the replica, per endpoint:
    an invalid target is a 400 from a medha replica, a 200 means it never got there."""
    out = {}
    for ep, extra in (
        ("completions", {"prompt": "route check"}),
        ("chat/completions", {"messages": [{"role": "system", "content": "route check"}]}),
    ):
        body = {"model": model, "max_tokens": 1, "medha": {"ttft_slo_s": -1}} | extra
        status = httpx.post(f"{base}/v1/{ep}", json=body, timeout=60).status_code
        out[ep] = status == 400
    return out


# --- one cell: fresh replicas, a router, a workload ------------------------------------------


def run_cell(name: str, workload: str, args, slo: Slo, calib: dict, log) -> dict:
    flags = ["--prefix-cache", "device", *args.replica_flags.split()]
    router_flags = []
    if args.profile:  # replicas and router plan with the same (one-core) profile
        flags += ["--predictor", f"profiled:{args.profile}"]
        router_flags += ["--predictor", f"profiled:{args.profile}"]
    with serving_replicas(2, flags, pin=not args.no_pin, log=log) as replicas:
        model = served_model(replicas[0])
        kv_tokens = replica_kv_tokens(replicas[0])
        t = time.perf_counter()
        with running_router(name, replicas, log=log, medha_flags=router_flags) as (
            base,
            cmd,
            pid,
        ):
            startup = time.perf_counter() - t
            forwarded = slo_field_forwarded(base, model)
            before = [replica_counters(u) for u in replicas]
            if workload == "multi_turn":
                cfg = ConversationTraceConfig(**(MULTI_TURN | args.multi_turn))
                load = conversations(cfg, args.num_requests, args.qps, args.seed)
            else:
                load = one_shots(workload, args)
            cpu = cpu_seconds(pid)
            results, wall = asyncio.run(run_workload(base, model, load, slo, calib["chat"]))
            cpu = cpu_seconds(pid) - cpu
            after = [replica_counters(u) for u in replicas]
            measures = router_measures(base) if name.startswith("medha-") else {}
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    twin = twin_trace(results)
    trace = Path(args.out) / f"twin-{name}-{workload}-{args.seed}-{time.time_ns()}.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in twin))
    return {
        "twin_trace": str(trace),
        "kv_tokens_per_replica": kv_tokens,
        "one_cache_hit_rate": one_cache_hit_rate(twin, 2 * kv_tokens),
        "contender": name,
        "workload": workload,
        "router_command": cmd,
        "router_startup_s": startup,
        "slo_field_forwarded": forwarded,
        "wall_s": wall,
        # the router's CPU seconds over the workload: taken from the replicas' two cores
        "router_cpu_s": cpu,
        "replicas": delta,
        # each replica's speed, as medha route measured it at the end; its prediction error
        # and the picks that error changed
        "router_slowdowns": measures.get("slowdowns"),
        "router_prediction_error_s": measures.get("prediction_error_s"),
        "router_tie_breaks": measures.get("tie_breaks"),
        "requests": [asdict(r) | {"text": None, "payload": None} for r in results],
    }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _length(r: dict) -> int:
    return r["prompt_tokens"] if r["prompt_tokens"] is not None else r["est_prompt_tokens"]


def slowest_short(cells: list[dict], k: int = 3) -> list[dict]:
    """The k slowest short requests (the ones a p99 over a few hundred is made of), each with
    what it met: its prompt, what the replica had cached of it, and how many requests of its
    cell were in flight (sent, not yet ended) when it was sent."""
    rows = []
    for c in cells:
        ok = [r for r in c["requests"] if r["status"] == "ok"]
        for r in ok:
            if _length(r) >= LONG_THRESHOLD:
                continue
            busy = sum(
                q is not r and q["sent_s"] <= r["sent_s"] < q["sent_s"] + q["e2e_s"] for q in ok
            )
            rows.append(
                {"round": c.get("round"), "index": r["index"], "turn": r["turn"],
                 "prompt_tokens": _length(r), "cached_tokens": r["cached_tokens"],
                 "in_flight": busy, "ttft_s": r["ttft_s"]}
            )  # fmt: skip
    return sorted(rows, key=lambda r: -r["ttft_s"])[:k]


def short_p99_floor(cells: list[dict], fit: list[float]) -> float | None:
    """A short-TTFT p99 no router can beat on these cells: every cell starts with idle replicas
    and empty caches, so its first request takes at least its isolated TTFT (the calibration's
    fit) whatever the router does; the p99 over the shorts with that for each cell's first
    request and 0 for every other."""
    a, b, c = fit
    floors = []
    for cell in cells:
        ok = [r for r in cell["requests"] if r["status"] == "ok"]
        short = [r for r in ok if _length(r) < LONG_THRESHOLD]
        sent = [r for r in cell["requests"] if r["status"] != "not sent"]
        first = min(sent, key=lambda r: r["sent_s"], default=None)
        for r in short:
            n = _length(r)
            floors.append(a + b * n + c * n * n if r is first else 0.0)
    return _pct(floors, 99)


def summarize(cells: list[dict], fit: list[float] | None = None) -> dict:
    """One contender's rounds of one workload, pooled: percentiles and attainment over every
    request, hit rate over the summed counters, hot-spot index and throughput averaged over
    rounds; with the calibration's `fit`, the short p99's floor."""
    reqs = [r for c in cells for r in c["requests"]]
    ok = [r for r in reqs if r["status"] == "ok"]
    short = [r["ttft_s"] for r in ok if _length(r) < LONG_THRESHOLD]
    met = sum(1 for r in ok if r["ttft_s"] <= r["target_s"])
    queries = sum(d["prefix_queries"] for c in cells for d in c["replicas"])
    hits = sum(d["prefix_hits"] for c in cells for d in c["replicas"])
    hot, hot_work = [], []
    for c in cells:
        counts = [d["requests"] for d in c["replicas"]]
        if sum(counts):
            hot.append(len(counts) * max(counts) / sum(counts))
        # the same over the prefill work each replica did: the prompt tokens its cache missed
        work = [d["prefix_queries"] - d["prefix_hits"] for d in c["replicas"]]
        if sum(work) > 0:
            hot_work.append(len(work) * max(work) / sum(work))
    # how far the router's predicted TTFT was from the measured one, per request (its own
    # clock starts when it has read the request, the client's when it sends it: a few ms)
    predicted = [r for r in ok if r.get("predicted_ttft_s") is not None]
    misses = [r["ttft_s"] - r["predicted_ttft_s"] for r in predicted]
    return {
        "requests": len(reqs),
        "errors": len(reqs) - len(ok),
        "predicted": len(predicted),
        "predicted_ttft_abs_error_p50_s": _pct([abs(m) for m in misses], 50),
        "predicted_ttft_error_p50_s": _pct(misses, 50),  # measured - predicted: + is late
        "short": len(short),
        "short_ttft_p50_s": _pct(short, 50),
        "short_ttft_p99_s": _pct(short, 99),
        "short_ttft_p99_floor_s": short_p99_floor(cells, fit) if fit else None,
        "short_ttft_slowest": slowest_short(cells),
        "ttft_p50_s": _pct([r["ttft_s"] for r in ok], 50),
        "slo_attainment": met / len(reqs) if reqs else None,
        "slo_misses": len(reqs) - met,
        "prefix_hit_rate": hits / queries if queries else None,
        "hot_spot_index": float(np.mean(hot)) if hot else None,
        "hot_spot_index_work": float(np.mean(hot_work)) if hot_work else None,
        "one_cache_hit_rate": _mean([c.get("one_cache_hit_rate") for c in cells]),
        "per_replica_requests": [[d["requests"] for d in c["replicas"]] for c in cells],
        "router_slowdowns": [c.get("router_slowdowns") for c in cells],
        "router_tie_breaks": [c.get("router_tie_breaks") for c in cells],
        "router_cpu_s_per_request": _mean(
            [
                c["router_cpu_s"] / len(c["requests"])
                for c in cells
                if c.get("router_cpu_s") is not None
            ]
        ),
        "requests_per_s": float(
            np.mean([sum(r["status"] == "ok" for r in c["requests"]) / c["wall_s"] for c in cells])
        ),
        "output_tokens_per_s": float(
            np.mean(
                [
                    sum(r["completion_tokens"] or 0 for r in c["requests"]) / c["wall_s"]
                    for c in cells
                ]
            )
        ),
        "slo_field_forwarded": cells[0]["slo_field_forwarded"],
    }


# --- calibration -----------------------------------------------------------------------------


def _ttft_alone(url: str, model: str, body: dict, endpoint: str) -> tuple[float, int]:
    res = Result("calibration", 0, None, 0.0, 0)
    body = {"model": model, "max_tokens": 1, "stream": True, "temperature": 0} | body
    body["stream_options"] = {"include_usage": True}

    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            await _send(client, f"{url}/v1/{endpoint}", body, {}, res, time.perf_counter())

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
        _ttft_alone(url, model, {"prompt": words(rng, 64)}, "completions")  # warm-up
        points = []
        for n in CALIBRATION_LENGTHS:
            ttft, tokens = _ttft_alone(url, model, {"prompt": words(rng, n)}, "completions")
            points.append((tokens, ttft, n))
        _, one = _ttft_alone(
            url,
            model,
            {"messages": [{"role": "user", "content": words(rng, 8)}]},
            "chat/completions",
        )
        _, two = _ttft_alone(
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


# --- main ------------------------------------------------------------------------------------


def _kv(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in MULTI_TURN:
            raise argparse.ArgumentTypeError(f"--multi-turn: unknown key {key!r}")
        out[key] = type(MULTI_TURN[key])(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contenders", default="all", help=f"comma-separated, or all: {CONTENDERS}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--qps", type=float, default=0.5, help="requests a second (default 0.5)")
    ap.add_argument("--num-requests", type=int, default=20, help="per workload (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--multi-turn",
        type=_kv,
        default={},
        help=f"ConversationTraceConfig fields, k=v,...: {MULTI_TURN}",
    )
    ap.add_argument("--sharegpt-max-prompt", type=int, default=512)
    ap.add_argument("--sharegpt-max-output", type=int, default=64)
    ap.add_argument("--ttft-slo-s", type=float, default=None, help="one fixed TTFT target")
    ap.add_argument(
        "--calibration", default=None, help="reuse the calibration of an earlier summary.json"
    )
    ap.add_argument("--replica-flags", default="", help="more `medha serve` flags, one string")
    ap.add_argument("--no-pin", action="store_true", help="no taskset: replicas share the cores")
    ap.add_argument("--install-peers", action="store_true", help="pip-install the peer routers")
    ap.add_argument(
        "--profile",
        default=None,
        help="a profile of one replica's core (`taskset -c 0 medha profile --out PATH`): the "
        "replicas and medha's router plan with it, and the digital twin replays each medha "
        "contender's run in `medha simulate` with it",
    )
    ap.add_argument("--out", default="runs/route_slo")
    ap.add_argument(
        "--report",
        metavar="SUMMARY",
        default=None,
        help="print the tables of an earlier run's summary.json again (its summaries "
        "recomputed from its cells) and run nothing",
    )
    args = ap.parse_args()
    if args.report:
        return report(Path(args.report))
    names = CONTENDERS if args.contenders == "all" else args.contenders.split(",")
    for name in names:
        try:
            contender(name)
        except ValueError as e:
            ap.error(str(e))
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.install_peers:
        print(f"peers installed in {install_peers()}")
    skipped: dict[str, str] = {}
    for name in names:
        try:
            check_installed(name)
        except Missing as e:
            skipped[name] = str(e)
            print(f"{name}: skipped: {e}")
    if len(skipped) == len(names):
        return
    with open(out / "servers.log", "a") as log:
        if args.calibration:
            calib = json.loads(Path(args.calibration).read_text())["calibration"]
        else:
            calib = calibrate(args, log)
            (out / "calibration.json").write_text(json.dumps({"calibration": calib}))
        a, b, c = calib["fit"]
        print(
            f"isolated TTFT(L) = {a:.3f} + {b * 1e3:.3f} ms x L + {c * 1e6:.4f} us x L^2; "
            f"{calib['tokens_per_word']:.2f} tokens a word"
        )
        slo = Slo(calib, args.ttft_slo_s)
        cells: list[dict] = []
        for rnd, name in alternated([n for n in names if n not in skipped], args.rounds):
            for workload in workloads:
                t = time.perf_counter()
                cell = run_cell(name, workload, args, slo, calib, log)
                cell["round"] = rnd
                cells.append(cell)
                # every cell kept as it ends: a later failure loses none
                (out / "cells.json").write_text(json.dumps(cells, indent=1))
                s = summarize([cell])
                print(
                    f"round {rnd} {name} {workload}: {s['requests']} requests, "
                    f"{s['errors']} errors, SLO {_fmt(s['slo_attainment'], '.0%')}, "
                    f"hits {_fmt(s['prefix_hit_rate'], '.0%')}, "
                    f"hot spot {_fmt(s['hot_spot_index'], '.2f')}, router CPU "
                    f"{_fmt(s['router_cpu_s_per_request'], '.4f')} s a request, router up in "
                    f"{cell['router_startup_s']:.1f} s ({time.perf_counter() - t:.0f} s)"
                )
    table = tables(cells, [n for n in names if n not in skipped], workloads, calib)
    summary = {
        "config": {k: v for k, v in vars(args).items()}
        | {"multi_turn_config": MULTI_TURN | args.multi_turn, "mixed": MIXED},
        "calibration": calib,
        "skipped": skipped,
        "summary": table,
        "cells": cells,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _print(table, skipped, args)
    if args.profile:
        summary["twin"] = twins(cells, args.profile)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.profile:
        print("\n| contender | workload | round | short TTFT p50 measured | simulated | error |")
        print("|---|---|---|---|---|---|")
        for t in summary["twin"]:
            print(
                f"| {t['contender']} | {t['workload']} | {t['round']} | "
                f"{t['measured_s']:.3f} s | {t['simulated_s']:.3f} s | {t['error']:+.0%} |"
            )
    print(f"\n{out / 'summary.json'}")


def tables(cells: list[dict], names: list[str], workloads: list[str], calib: dict) -> dict:
    """Each workload's summary of each contender, pooled over rounds."""
    return {
        w: {
            n: summarize(
                [c for c in cells if c["contender"] == n and c["workload"] == w], calib["fit"]
            )
            for n in names
        }
        for w in workloads
    }


def report(path: Path) -> None:
    """An earlier run's tables again, from its summary.json."""
    summary = json.loads(path.read_text())
    cells = summary["cells"]
    names = list(dict.fromkeys(c["contender"] for c in cells))
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    config = argparse.Namespace(**summary["config"])
    _print(tables(cells, names, workloads, summary["calibration"]), summary["skipped"], config)


def twins(cells: list[dict], profile: str) -> list[dict]:
    """Each medha contender's run against its twin: short-request TTFT p50."""
    out = []
    for cell in cells:
        if not cell["contender"].startswith("medha-"):
            continue
        measured = summarize([cell])["short_ttft_p50_s"]
        simulated = simulate_twin(cell, profile)
        if measured and simulated is not None:
            out.append(
                {"contender": cell["contender"], "workload": cell["workload"],
                 "round": cell["round"], "measured_s": measured, "simulated_s": simulated,
                 "error": (simulated - measured) / measured}
            )  # fmt: skip
    return out


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _print(table: dict, skipped: dict, args) -> None:
    for w, rows in table.items():
        print(f"\n{w}: {args.num_requests} requests x {args.rounds} rounds, {args.qps} req/s\n")
        print(
            "| contender | short TTFT p50 | short TTFT p99 | SLO met | misses | prefix hits "
            "(one cache) | hot spot: requests / prefill work | req/s | out tok/s | errors |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, s in rows.items():
            print(
                f"| {name} | {_fmt(s['short_ttft_p50_s'], '.3f')} s | "
                f"{_fmt(s['short_ttft_p99_s'], '.3f')} s | {_fmt(s['slo_attainment'], '.0%')} | "
                f"{s['slo_misses']} | {_fmt(s['prefix_hit_rate'], '.1%')} "
                f"({_fmt(s['one_cache_hit_rate'], '.1%')}) | "
                f"{_fmt(s['hot_spot_index'], '.2f')} / {_fmt(s['hot_spot_index_work'], '.2f')} | "
                f"{s['requests_per_s']:.3f} | "
                f"{s['output_tokens_per_s']:.1f} | {s['errors']} |"
            )
        for name, s in rows.items():
            if s.get("router_cpu_s_per_request") is not None:
                print(
                    f"{name}: the router's CPU time, {1e3 * s['router_cpu_s_per_request']:.1f} ms "
                    "a request (taken from the replicas' cores unless they are pinned apart)"
                )
            if s.get("predicted"):
                print(
                    f"{name}: predicted TTFT against measured over {s['predicted']} requests: "
                    f"median |error| {s['predicted_ttft_abs_error_p50_s']:.3f} s, median "
                    f"measured - predicted {s['predicted_ttft_error_p50_s']:+.3f} s"
                )
            if any(s.get("router_slowdowns") or ()):
                speeds = "; ".join(
                    ", ".join(f"{x:.2f}" for x in cell) for cell in s["router_slowdowns"] if cell
                )
                print(f"{name}: each replica's slowdown at the end, by round: {speeds}")
            if any(n is not None for n in s.get("router_tie_breaks") or ()):
                ties = s["router_tie_breaks"]
                print(f"{name}: picks its prediction error changed, by round: {ties}")
            slowest = "; ".join(
                f"{r['ttft_s']:.3f} s (round {r['round']}, #{r['index']}"
                + ("" if r["turn"] is None else f" turn {r['turn']}")
                + f", {r['prompt_tokens']} tokens, {r['cached_tokens']} cached, "
                f"{r['in_flight']} in flight)"
                for r in s.get("short_ttft_slowest") or ()
            )
            if slowest:
                print(f"{name}: the slowest short requests: {slowest}")
        # (0 where the cells' first requests are too few to reach the p99)
        floors = {
            round(s["short_ttft_p99_floor_s"], 3)
            for s in rows.values()
            if s.get("short_ttft_p99_floor_s")
        }
        if floors:
            print(
                f"short TTFT p99 no router can beat here (each cell's first request, sent to "
                f"idle replicas with empty caches, at its isolated TTFT): "
                f"{' / '.join(f'{f:.3f} s' for f in sorted(floors))}"
            )
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}")


if __name__ == "__main__":
    main()
