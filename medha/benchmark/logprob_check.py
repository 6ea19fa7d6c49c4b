"""The engine's logprobs held to transformers' float32 logits, within the rounding bound of
medha/benchmark/numerics.py: what the engine computed, where its greedy tokens only say what
it decided.

The tiny random Llama of the engine tests mostly repeats one token whatever its context
holds: a KV block read from the wrong place (swapped back into another slot, a cache hit one
token too long, a chunk that misses the one before it) leaves its greedy tokens as they were,
while its logits move by a hundred times the rounding bound or more. The engine reports, per
generated token, the logprobs of its top tokens (`SamplingParams(logprobs=k)`); transformers
prefills the same context (prompt, then the tokens the engine chose) in float32. The
difference of two logprobs of one row is the difference of their logits: log_softmax
subtracts the row's maximum m and log-sum L, the same two floats for every entry, so they
cancel, rounding and all. What is left is the two logits' bounds (`LogitBound.between_two`,
one evaluation each side) plus the rounding of (z_i - m) - L (or of z_i - (m + L)): at most
two roundings, each at most u |logprob_i| in float32 (u = 2^-24; |z_i - m| <= |logprob_i| as
L >= 0), for each of the two logprobs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from medha.benchmark.numerics import UNIT_ROUNDOFF, assert_logits_within, logit_bound


@functools.lru_cache(maxsize=32)
def _reference_rows(model_dir: str, ids: tuple[int, ...], first: int):
    """transformers' logits and their bound (between two evaluations) at positions `first`
    on of a prefill of `ids`: the rows that chose ids[first + 1:] (copies, so that the whole
    prefill's tensors are freed)."""
    bound = logit_bound(model_dir, list(ids))
    return bound.logits[first:].clone(), bound.between_two()[first:].clone()


def assert_logprobs_agree(model_dir: str | Path, prompts: list[list[int]], outputs) -> float:
    """Each output of `prompts` (RequestOutputs of a float32 engine run with `logprobs` set)
    has, at every generated token, greedy or sampled, top logprobs whose differences from the
    chosen token's are transformers' logit differences within rounding. Outputs that ended in
    an error are left out. Returns the largest |difference| / bound seen (at most 1)."""
    u = UNIT_ROUNDOFF[torch.float32]
    worst = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        if out.finish_reason == "error":
            continue
        assert out.logprobs and len(out.logprobs) == len(out.token_ids), (
            f"{out.request_id}: {len(out.logprobs or [])} logprobs for "
            f"{len(out.token_ids)} tokens (run it with SamplingParams(logprobs=k))"
        )
        context = tuple(prompt) + tuple(out.token_ids)
        z, bound = _reference_rows(str(model_dir), context[:-1], len(prompt) - 1)
        chosen = torch.tensor([[s.token] for s in out.logprobs])
        top = torch.tensor([[i for i, _ in s.top_logprobs] for s in out.logprobs])
        lp = torch.tensor([[v for _, v in s.top_logprobs] for s in out.logprobs]).double()
        lp_chosen = torch.tensor([[s.logprob] for s in out.logprobs]).double()
        expected = z.gather(1, top).double() - z.gather(1, chosen).double()
        tolerance = (
            bound.gather(1, top).double()
            + bound.gather(1, chosen).double()
            + 2 * u * (lp.abs() + lp_chosen.abs())
        )
        try:
            worst = max(worst, assert_logits_within(lp - lp_chosen, expected, tolerance))
        except AssertionError as e:
            raise AssertionError(
                f"{out.request_id}, logprobs of the top {top.shape[1]} tokens relative to the "
                f"chosen one (flat index = generated token * {top.shape[1]} + rank): {e}"
            ) from None
    return worst
