"""The workloads of bench/route/route_slo.py, all real text sent through the OpenAI API: multi-turn
conversations (`conversations`: the whole history each turn, closed-loop), questions about a few
shared documents (`shared_prefix`), and one-shot prompts of `medha bench`'s mixed workload or the
bundled ShareGPT trace's lengths (`one_shots`). Prompts are words SmolLM2 tokenizes one token
each (`WORDS`), so the client knows a prompt's length before sending it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from medha.benchmark.workload import build_requests
from medha.sim.workload.prefix_trace import ConversationTraceConfig

WORKLOADS = ("multi_turn", "shared_prefix", "mixed", "sharegpt")
MIXED = "prompt=32-256,output=16-48,long_fraction=0.05,long_prompt=3000-6000"
SHAREGPT = Path(__file__).resolve().parents[1] / (
    "data/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
)
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


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


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
    """The one-shot workload `name` (shared_prefix, mixed or sharegpt) at args.qps, with
    args.num_requests requests from args.seed; ShareGPT's lengths clipped to
    args.sharegpt_max_prompt and args.sharegpt_max_output."""
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
