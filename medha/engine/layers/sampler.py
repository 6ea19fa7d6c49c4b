"""Next-token choice for every sampling position of a batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from medha.engine.errors import RequestFailedError, blame
from medha.engine.sampling_params import SamplingParams


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature  # >= MIN_TEMPERATURE here: finite in float32
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p; the likeliest token always stays,
        # as the mass before it is 0, below any top_p SamplingParams accepts
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    request_ids: list[str],
) -> list[Sample | RequestFailedError]:
    """logits: [rows, vocab] fp32, on the model's device. Greedy rows are decided together;
    the others one by one on the host with their own generator, so a seeded request samples
    the same tokens in any batch and on any device.

    One pass over the logits where they are finds each row's largest logit and its index: the
    greedy token, and the row's health (a NaN anywhere makes the largest NaN, +inf makes it
    +inf). Only those two numbers a row cross to the host, in one copy; a row's whole logits
    follow only where sampling or logprobs need them.

    A row whose own work fails comes back as the RequestFailedError that ends its request
    (non-finite logits, or an error sampling it); the other rows are unaffected."""
    if not params:
        return []
    largest, index = logits.max(-1)  # the first index of the largest, as argmax gives
    # float64 holds every token id exactly: one transfer for both
    largest, index = torch.stack((largest.double(), index.double())).tolist()
    # NaN or +inf from the model (an fp16/bf16 overflow, say) would sample garbage silently;
    # a row of -inf (every token masked) is no error
    out: list[Sample | RequestFailedError | None] = [
        RequestFailedError(rid, "the model produced non-finite logits")
        if math.isnan(m) or m == math.inf
        else None
        for rid, m in zip(request_ids, largest)
    ]
    whole = [
        i
        for i, p in enumerate(params)
        if out[i] is None and (not p.greedy or p.logprobs is not None)
    ]
    rows = dict(zip(whole, logits[whole].cpu() if whole else ()))
    for i, p in enumerate(params):
        if p.greedy and out[i] is None:
            out[i] = Sample(int(index[i]))
    for i, p in enumerate(params):
        try:
            with blame(request_ids[i]):
                if out[i] is None:
                    probs = _filter(rows[i], p).softmax(-1)
                    out[i] = Sample(
                        int(torch.multinomial(probs, 1, generator=generators[i]).item())
                    )
                if p.logprobs is not None and isinstance(out[i], Sample):
                    _add_logprobs(out[i], rows[i], p.logprobs)
        except RequestFailedError as e:
            out[i] = e
    return out


def _add_logprobs(s: Sample, logits: torch.Tensor, top: int) -> None:
    """Logprobs of the model's own distribution, before temperature and cuts."""
    lp = logits.log_softmax(-1)
    s.logprob = float(lp[s.token])
    if top:
        values, ids = lp.topk(top)
        s.top_logprobs = list(zip(ids.tolist(), values.tolist()))
    else:
        s.top_logprobs = []
