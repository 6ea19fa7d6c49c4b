"""Next-token choice for every sampling position of a batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medha.engine.sampling_params import SamplingParams


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[Sample]:
    """logits: [rows, vocab] fp32. Greedy rows are decided together; the others one by one
    with their own generator, so a seeded request samples the same tokens in any batch."""
    out: list[Sample | None] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens = logits[greedy].argmax(-1).tolist()
        for i, t in zip(greedy, tokens):
            out[i] = Sample(t)
    for i, p in enumerate(params):
        if out[i] is None:
            probs = _filter(logits[i], p).softmax(-1)
            out[i] = Sample(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    for i, p in enumerate(params):
        if p.logprobs is not None:
            # logprobs of the model's own distribution, before temperature and cuts
            lp = logits[i].log_softmax(-1)
            s = out[i]
            s.logprob = float(lp[s.token])
            if p.logprobs:
                values, ids = lp.topk(p.logprobs)
                s.top_logprobs = list(zip(ids.tolist(), values.tolist()))
            else:
                s.top_logprobs = []
    return out
