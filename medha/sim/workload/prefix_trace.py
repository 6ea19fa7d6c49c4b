"""Traces with prefix structure: a generator of multi-turn conversations and shared system
prompts in the Mooncake format, and what a trace's hash ids say about reuse.

A conversation resends its whole history each turn: turn k's prompt is the system prompt (if
any, shared by many conversations), every earlier user message and answer, and the new
message. A 512-token block of a prompt is identified by what it holds: blocks wholly inside a
system prompt by (system prompt, position), the others by (conversation, position, end), so
two prompts share a block id exactly when they share its tokens and every token before it
(ids are prefix-chained, as in Mooncake's traces; a partial last block has an id of its own).
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from medha.core.request import PREFIX_HASH_BLOCK
from medha.sim.workload.traces import TraceEntry


@dataclass
class ConversationTraceConfig:
    conversations: int = field(default=200, metadata={"help": "conversations to generate"})
    conversation_rate: float = field(
        default=0.5, metadata={"help": "new conversations per second (Poisson)"}
    )
    system_prompts: int = field(
        default=4, metadata={"help": "distinct system prompts the conversations share"}
    )
    system_prompt_share: float = field(
        default=0.8, metadata={"help": "share of conversations that start with a system prompt"}
    )
    system_prompt_tokens: int = field(
        default=2000, metadata={"help": "tokens of each system prompt"}
    )
    mean_turns: float = field(
        default=5.0, metadata={"help": "mean turns per conversation (geometric, at least 1)"}
    )
    user_tokens: int = field(
        default=300, metadata={"help": "median tokens of a user message (log-normal, sigma 1)"}
    )
    output_tokens: int = field(
        default=250, metadata={"help": "median tokens of an answer (log-normal, sigma 0.7)"}
    )
    think_s: float = field(
        default=30.0,
        metadata={"help": "median seconds from one turn's answer to the next turn (log-normal)"},
    )
    max_context: int = field(
        default=32768, metadata={"help": "a conversation ends before its prompt passes this"}
    )
    seed: int = field(default=0, metadata={"help": "random seed"})

    def __post_init__(self) -> None:
        for name in ("conversations", "system_prompt_tokens", "user_tokens", "output_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not (isinstance(self.system_prompts, int) and self.system_prompts >= 0):
            raise ValueError(f"system_prompts must be an integer >= 0, got {self.system_prompts!r}")
        for name in ("conversation_rate", "think_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not (isinstance(self.mean_turns, (int, float)) and 1 <= self.mean_turns < 1e6):
            raise ValueError(f"mean_turns must lie in [1, 1e6), got {self.mean_turns!r}")
        if not 0 <= self.system_prompt_share <= 1:
            raise ValueError(
                f"system_prompt_share must lie in [0, 1], got {self.system_prompt_share!r}"
            )
        if not (isinstance(self.max_context, int) and self.max_context >= 2):
            raise ValueError(f"max_context must be an integer >= 2, got {self.max_context!r}")


def generate_conversations(cfg: ConversationTraceConfig) -> list[TraceEntry]:
    """The requests of `cfg`'s conversations, in arrival order; the same config always gives
    the same trace."""
    rng = random.Random(cfg.seed)
    ids: dict[tuple, int] = {}

    def block_ids(system: int | None, conv: int, length: int) -> tuple[int, ...]:
        sys_len = cfg.system_prompt_tokens if system is not None else 0
        out = []
        for j in range(-(-length // PREFIX_HASH_BLOCK)):
            end = min((j + 1) * PREFIX_HASH_BLOCK, length)
            key = ("s", system, j, end) if end <= sys_len else ("c", conv, j, end)
            out.append(ids.setdefault(key, len(ids)))
        return tuple(out)

    def lognormal(median: float, sigma: float) -> int:
        return max(1, int(rng.lognormvariate(math.log(median), sigma)))

    entries: list[TraceEntry] = []
    start = 0.0
    for conv in range(cfg.conversations):
        start += rng.expovariate(cfg.conversation_rate)
        system = None
        if cfg.system_prompts and rng.random() < cfg.system_prompt_share:
            system = rng.randrange(cfg.system_prompts)
        history = cfg.system_prompt_tokens if system is not None else 0
        at = start
        turns = 1
        if cfg.mean_turns > 1:  # geometric with mean `mean_turns`
            turns += int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / cfg.mean_turns))
        for _ in range(turns):
            prompt = history + lognormal(cfg.user_tokens, 1.0)
            output = lognormal(cfg.output_tokens, 0.7)
            if prompt + output > cfg.max_context:
                break
            entries.append(TraceEntry(at, prompt, output, block_ids(system, conv, prompt)))
            history = prompt + output
            # the answer streams (about 30 ms a token), then the user reads and types
            at += output * 0.03 + rng.lognormvariate(math.log(cfg.think_s), 1.0)
    entries.sort(key=lambda e: e.arrival_s)
    t0 = entries[0].arrival_s if entries else 0.0
    return [TraceEntry(e.arrival_s - t0, e.prompt_len, e.output_len, e.hash_ids) for e in entries]


def write_trace(entries: list[TraceEntry], path: str, fmt: str = "jsonl") -> None:
    """Mooncake JSONL (timestamp in ms), or its CSV form (hash ids separated by spaces)."""
    with open(path, "w", newline="") as fh:
        if fmt == "csv":
            fh.write("timestamp,input_length,output_length,hash_ids\n")
        for e in entries:
            ms = round(e.arrival_s * 1e3, 3)
            ids = list(e.hash_ids or ())
            if fmt == "csv":
                fh.write(f"{ms},{e.prompt_len},{e.output_len},{' '.join(map(str, ids))}\n")
            else:
                row = {
                    "timestamp": ms,
                    "input_length": e.prompt_len,
                    "output_length": e.output_len,
                    "hash_ids": ids,
                }
                fh.write(json.dumps(row) + "\n")


def reuse_by_lru(entries: list[TraceEntry], capacities: list[int]) -> dict:
    """Prompt tokens of a trace with hash ids, in arrival order: the reusable ones (the longest
    prefix of ids some earlier request had: an unbounded cache) and those an LRU cache of each
    capacity in tokens (whole 512-token blocks) would hold when the request comes. Timing is
    left out: every earlier request counts as computed."""
    total = sum(e.prompt_len for e in entries)
    out = {"requests": len(entries), "prompt_tokens": total}
    for cap in [None, *capacities]:
        lru: OrderedDict[int, None] = OrderedDict()
        limit = math.inf if cap is None else cap // PREFIX_HASH_BLOCK
        hit = 0
        for e in entries:
            ids = e.hash_ids or ()
            k = 0
            while k < len(ids) and ids[k] in lru:
                k += 1
            hit += min(k * PREFIX_HASH_BLOCK, e.prompt_len)
            for i in ids:
                lru[i] = None
                lru.move_to_end(i)
            while len(lru) > limit:
                lru.popitem(last=False)
        key = "unbounded" if cap is None else f"lru_{cap}"
        out[key] = {"hit_tokens": hit, "fraction": hit / total if total else 0.0}
    return out
