"""What the engine reports of a request (RequestOutput, built by `request_output` alone) and what
it keeps of one beside the scheduler's Request, which alone holds its tokens (RequestState)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from medha.core.request import Request
from medha.engine.errors import RequestFailedError
from medha.engine.layers.sampler import Sample
from medha.engine.sampling_params import SamplingParams
from medha.engine.tokenizer import Detokenizer, Tokenizer


@dataclass
class RequestOutput:
    """What one step did for one request. Per-step fields (`new_token_ids`, `delta_text`,
    `logprobs`) cost the same at any context length: `text` is the detokenizer's string,
    `prompt_token_ids` the request's own list (shared: do not modify it), and `token_ids`,
    every generated token, comes with the final output only (None before)."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    text: str
    token_ids: list[int] | None
    finished: bool
    finish_reason: str | None
    prompt_token_ids: list[int]
    logprobs: list[Sample] | None = None  # per new token, when asked for
    metrics: dict | None = None  # TTFT etc. once finished
    error: str | None = None  # why it failed, with finish_reason "error"


@dataclass
class RequestState:
    params: SamplingParams
    detok: Detokenizer
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    logprobs: list[Sample] = field(default_factory=list)

    @classmethod
    def new(cls, params: SamplingParams, tokenizer: Tokenizer) -> RequestState:
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and tokenizer.eos_token_id is not None:
            stop_ids.add(tokenizer.eos_token_id)
        return cls(params, Detokenizer(tokenizer, params.stop), generator, frozenset(stop_ids))

    def add(self, smp: Sample) -> tuple[str, bool]:
        """Add a sampled token to the output (the scheduler adds it to the request's tokens):
        (the text it makes safe to emit, whether it ends the request)."""
        if self.params.logprobs is not None:
            self.logprobs.append(smp)
        if smp.token in self.stop_ids:
            return self.detok.flush(), True
        delta = self.detok.add(smp.token)
        return delta, self.detok.stopped


def request_output(
    request_id: str,
    request: Request | None,
    state: RequestState | None,
    *,
    sample: Sample | None = None,
    delta: str = "",
    end: Request | None = None,
    error: RequestFailedError | None = None,
) -> RequestOutput:
    """A step's output for one request: with the token `sample` and its text `delta`, finished
    when the scheduler ended it (`end`) or it failed (`error`). `request` and `state` are None
    where the request is already gone (it failed after an abort)."""
    finished = end is not None or error is not None
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[] if sample is None else [sample.token],
        delta_text=delta,
        text=state.detok.text if state else "",
        token_ids=(list(request.output_token_ids) if request else []) if finished else None,
        finished=finished,
        finish_reason="error" if error is not None else end.finish_reason if end else None,
        prompt_token_ids=request.prompt_token_ids if request else [],
        logprobs=[sample] if sample is not None and state.params.logprobs is not None else None,
        metrics=_request_metrics(end) if end else None,
        error=error.detail if error is not None else None,
    )


def _request_metrics(r: Request) -> dict:
    t = r.token_times_s
    return {
        "ttft_s": t[0] - r.arrival_s,
        "e2e_s": r.finish_s - r.arrival_s,
        "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
        "preemptions": r.num_preemptions,
        "prompt_tokens": r.prompt_len,
        "cached_prompt_tokens": r.num_cached_tokens,
        "completion_tokens": r.num_output_tokens,
    }
