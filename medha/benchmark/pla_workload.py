"""bench/paper/sim_pla_serve.py's workloads: synthetic multi-turn conversations shaped to the
PLA-Serve paper's Figure 2 (log-normal first prompts and later messages, geometric turn counts),
sent by closed-loop clients (`ClosedLoop`) or as Poisson arrivals (`poisson`); every request
carries the paper's 0.4 s TTFT SLO. With `history`, a turn's prompt is the session's context so
far as token ids (a prefix cache may hold it); without, it is the new message's length alone.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from medha.core.request import Request

SLO_S = 0.4
MAX_PROMPT = 8192


@dataclass(frozen=True)
class Shape:
    """Token counts of a conversation: (median, sigma) of log-normal first prompts and later
    messages, the mean number of turns."""

    first: tuple[float, float]
    later: tuple[float, float]
    turns: float


def lognormal_for(median: float, below_256: float) -> tuple[float, float]:
    """(median, sigma) such that P(X < 256) = below_256."""
    z = statistics.NormalDist().inv_cdf(below_256)
    return median, math.log(256 / median) / z


# LMsys: Figure 2's 63% / 81% under 256 tokens; 2.0 turns a conversation (LMsys-Chat-1M's mean)
LMSYS = Shape(lognormal_for(140, 0.63), lognormal_for(60, 0.81), 2.0)
# ShareGPT: longer conversations with longer messages (our assumption: 55% / 75%, 3.5 turns)
SHAREGPT = Shape(lognormal_for(200, 0.55), lognormal_for(90, 0.75), 3.5)


def draw(rng: random.Random, shape: tuple[float, float]) -> int:
    median, sigma = shape
    return max(4, min(MAX_PROMPT, round(median * math.exp(rng.gauss(0, sigma)))))


class Sessions:
    """Conversations drawn one after another; each yields its turns' prompts as token ids
    (`history`: the turn carries its context, which the prefix cache may hold) or lengths."""

    def __init__(self, shape: Shape, seed: int, history: bool) -> None:
        self.shape, self.rng, self.history = shape, random.Random(seed), history
        self.count = 0

    def session(self):
        rng, sid = self.rng, self.count
        self.count += 1
        p = 1 / self.shape.turns  # geometric, mean `turns`
        turns = 1 if p >= 1 else 1 + int(math.log(1 - rng.random()) / math.log(1 - p))
        context = 0
        for t in range(turns):
            new = draw(rng, self.shape.first if t == 0 else self.shape.later)
            if context + new > MAX_PROMPT:
                return
            context += new
            if self.history:
                base = sid * 10_000
                yield context, list(range(base, base + context))
            else:
                yield new, None


def request(rid: str, t: float, prompt: int, ids: list[int] | None, output: int = 1) -> Request:
    if ids is not None:
        return Request.from_tokens(rid, t, ids, output, ttft_deadline_s=SLO_S)
    return Request(rid, t, prompt, output, ttft_deadline_s=SLO_S)


class ClosedLoop:
    """`clients` clients, each sending its next turn (or a new session's first) when the last
    finished, after an exponential think time (mean `think_s`; 0: at once), until `total`."""

    def __init__(self, sessions: Sessions, clients: int, total: int, think_s: float, seed: int):
        self.sessions, self.total, self.think_s = sessions, total, think_s
        self.rng = random.Random(seed + 1)
        self.sent = 0
        self.turns = {}
        self.first = [self._next(c, 0.0) for c in range(clients)]

    def _next(self, client: int, now: float) -> Request | None:
        if self.sent >= self.total:
            return None
        it = self.turns.get(client)
        turn = next(it, None) if it else None
        while turn is None:
            it = self.turns[client] = self.sessions.session()
            turn = next(it, None)
        self.sent += 1
        t = now + (self.rng.expovariate(1 / self.think_s) if self.think_s else 0.0)
        return request(f"c{client}-{self.sent}", t, *turn)

    def on_finish(self, r: Request, now: float) -> list[Request]:
        client = int(r.request_id[1:].split("-")[0])
        nxt = self._next(client, now)
        return [nxt] if nxt else []


def poisson(shape: Shape, rate: float, n: int, seed: int, history: bool) -> list[Request]:
    """Sessions start as a Poisson process; turns follow at once as further arrivals of the
    same process (the paper's arrivals are Poisson at rate lambda)."""
    rng, sessions = random.Random(seed), Sessions(shape, seed, history)
    out, t = [], 0.0
    it = sessions.session()
    while len(out) < n:
        turn = next(it, None)
        if turn is None:
            it = sessions.session()
            continue
        t += rng.expovariate(rate)
        out.append(request(f"r{len(out)}", t, *turn))
    return out
