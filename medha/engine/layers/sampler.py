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


@dataclass
class DeviceSample:
    """What a step's sampling computed where its logits are (start_sampling), on its way to
    the host: each row's largest logit and its index (the greedy token), and the whole logits
    of the rows that sample or report logprobs on the host."""

    index: torch.Tensor  # [rows] int64 on the device: the next step may read tokens from it
    host: torch.Tensor  # [2, rows] float64: largest logit, index (a copy in flight on CUDA)
    whole: dict[int, torch.Tensor]  # row -> its logits [vocab] fp32 (a copy in flight on CUDA)
    ready: torch.cuda.Event | None  # recorded after the copies (None: a CPU's are done)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def start_sampling(logits: torch.Tensor, on_host: list[bool]) -> DeviceSample:
    """The device's half of sampling a batch's rows (`on_host`: the rows that sample or
    report logprobs on the host, whose whole logits are copied): one pass over the logits
    finds each row's largest logit and its index, and only those two numbers a row cross to
    the host, in one copy, without waiting for it (finish_sampling does)."""
    largest, index = logits.max(-1)  # the first index of the largest, as argmax gives
    stacked = torch.stack((largest.double(), index.double()))  # float64 holds every id exactly
    whole_rows = [i for i, h in enumerate(on_host) if h]
    whole = logits[whole_rows] if whole_rows else None
    if logits.device.type != "cuda":
        return DeviceSample(
            index, stacked, dict(zip(whole_rows, () if whole is None else whole)), None
        )
    host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    rows = {}
    if whole is not None:
        pinned = torch.empty(whole.shape, dtype=whole.dtype, pin_memory=True)
        pinned.copy_(whole, non_blocking=True)
        rows = dict(zip(whole_rows, pinned))
    ready = torch.cuda.Event()
    ready.record()
    return DeviceSample(index, host, rows, ready)


def finish_sampling(
    started: DeviceSample,
    rows: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    request_ids: list[str],
) -> list[Sample | RequestFailedError]:
    """The host's half, for the batch's rows `rows` (the others' requests ended meanwhile),
    each with its request's params, generator and id. Greedy rows take their index; the
    others sample one by one with their own generator, so a seeded request samples the same
    tokens in any batch and on any device.

    A row whose own work fails comes back as the RequestFailedError that ends its request
    (non-finite logits, or an error sampling it); the other rows are unaffected."""
    started.wait()
    largest, index = started.host.tolist()
    out: list[Sample | RequestFailedError] = []
    for row, p, generator, rid in zip(rows, params, generators, request_ids):
        m = largest[row]
        # NaN or +inf from the model (an fp16/bf16 overflow, say) would sample garbage
        # silently (a NaN anywhere makes the largest NaN); a row of -inf (every token
        # masked) is no error
        if math.isnan(m) or m == math.inf:
            out.append(RequestFailedError(rid, "the model produced non-finite logits"))
            continue
        try:
            with blame(rid):
                if p.greedy:
                    s = Sample(int(index[row]))
                else:
                    probs = _filter(started.whole[row], p).softmax(-1)
                    s = Sample(int(torch.multinomial(probs, 1, generator=generator).item()))
                if p.logprobs is not None:
                    _add_logprobs(s, started.whole[row], p.logprobs)
            out.append(s)
        except RequestFailedError as e:
            out.append(e)
    return out


def on_host(p: SamplingParams) -> bool:
    """Whether a request's sampling needs its row's whole logits on the host."""
    return not p.greedy or p.logprobs is not None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    request_ids: list[str],
) -> list[Sample | RequestFailedError]:
    """logits: [rows, vocab] fp32, on the model's device: both halves at once."""
    started = start_sampling(logits, [on_host(p) for p in params])
    return finish_sampling(started, list(range(len(params))), params, generators, request_ids)


def _add_logprobs(s: Sample, logits: torch.Tensor, top: int) -> None:
    """Logprobs of the model's own distribution, before temperature and cuts."""
    lp = logits.log_softmax(-1)
    s.logprob = float(lp[s.token])
    if top:
        values, ids = lp.topk(top)
        s.top_logprobs = list(zip(ids.tolist(), values.tolist()))
    else:
        s.top_logprobs = []
