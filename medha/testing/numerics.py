"""How far two evaluations of one model may differ by rounding alone, and the comparisons that
use it: logits within a bound derived from the computation, and greedy tokens that agree
wherever the reference's choice is no near-tie. Every test and benchmark that compares medha's
logits or tokens with another evaluation (transformers, another chunking, layout, kernel or
batch) states its tolerance through this module, so that it holds on any CPU: the GEMM kernels
of AVX2, AVX-512 and AMX, oneDNN and MKL, one thread or several, sum in different orders.

The bound (per logit)
---------------------
A logit is a dot product z_i = sum_j W_ij h_j of the final normed hidden state h (length d)
with a row of the output head W. Two evaluations of the same model differ only in the order
(and blocking) of every sum on the way, and in the kernels' rounding of elementwise ops.

1. One sum of n terms computed in floating point with unit roundoff u has an error of at most
   gamma_n * sum|terms|, gamma_n = n u / (1 - n u), in the worst case (Higham, *Accuracy and
   Stability of Numerical Algorithms*, 2nd ed., eq. 3.5). The worst case needs every rounding
   to go the same way; modelling the roundings as independent, mean-zero and bounded by u,
   the error is at most lambda * sqrt(n) * u * sum|terms| with probability at least
   1 - 2 n exp(-lambda^2 / 2) (Higham and Mary, "A new approach to probabilistic rounding
   error analysis", SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4). That is the scaling with
   the reduction length, and it is what blocked and vectorised kernels show in practice.
2. The values' magnitude is M_i = sum_j |W_ij| |h_j|, the sum of the final product's terms'
   magnitudes (not |z_i|: a logit near zero is a cancellation of large terms and carries
   their absolute error).
3. Rounding errors made upstream reach z_i through h. The model assumed here is that a
   Llama's layers carry a relative error through without amplifying it (the residual stream
   adds each layer's output; RMSNorm rescales error and value alike), so that every reduction
   on a logit's path contributes, relative to M_i, as if it were part of one long sum. The
   path's length n is the sum of the reduction lengths a value passes through: per layer the
   q/k/v projections (d), the scores (head_dim), the weighted sum over the context (its
   length), the output projection (heads * head_dim), the MLP's gate/up (d) and down
   (intermediate) projections; then the head (d). For SmolLM2-135M at 400 tokens of context
   n = 112,416, sqrt(n) = 335.
4. lambda is chosen so that the chance of a false alarm anywhere in a comparison of N logits
   is at most `false_alarm` (union bound): 2 n N exp(-lambda^2 / 2) <= false_alarm. For
   SmolLM2 (N = 400 x 49,152 logits) lambda = 8.6.

So tolerance_i = lambda * sqrt(n) * u * M_i for one evaluation's distance from exact
arithmetic, and twice that between two evaluations. Measured on a 2-core AVX-512 EPYC
(docs/engine.md "Correctness"): transformers in float32 against float64 reaches 15 u M_i at
most (mean 1.4 u M_i), chunked prefills against a whole one 18 u M_i, while the bound between
two evaluations is about 5,800 u M_i; a chunk boundary off by one moves logits by orders of
magnitude more than the bound (tests/test_engine.py). The bound's assumption (3) is checked,
not taken on trust: tests/test_engine.py holds transformers' own float32 logits to it against
float64.

Decisions
---------
What the engine decides from logits is the greedy token. Where the reference's top two logits
are further apart than the two logits' tolerances added, every evaluation within the bound
picks the reference's token; where they are closer (a near-tie), either token is a correct
float32 answer and the sequences may part there. `assert_greedy_agrees` checks exactly that.

bfloat16
--------
No bound derived beforehand fits bf16: its unit roundoff (2^-8) over the same path makes every
top two a near-tie. Its yardstick is measured instead, on the CPU the test runs on:
`chunked_logits` evaluates transformers' bf16 model in chunks, another summation order of the
same kernels, and the largest move of a logit between orders is what any other bf16 evaluation
(medha's, batched with other prompts) may also move it by.

Logprobs
--------
A greedy token says what was decided, not what was computed: the tiny random Llama of the
engine tests mostly repeats one token whatever its context holds, so a KV block read from the
wrong place (swapped back into another slot, a cache hit one token too long) leaves its tokens
as they were while its logits move by a hundred times the bound or more.
`assert_logprobs_agree` holds the engine's reported top logprobs (`SamplingParams(logprobs=k)`)
to transformers' float32 logits on the same context (the prompt, then the tokens the engine
chose, greedy or sampled). Two logprobs of one row differ by their logits' difference:
log_softmax subtracts the row's maximum m and log-sum L, the same two floats for every entry,
so they cancel, rounding and all. What is left is the two logits' bounds (one evaluation each
side) plus the rounding of (z_i - m) - L: at most two roundings, each at most u |logprob_i|
(|z_i - m| <= |logprob_i| as L >= 0), for each of the two logprobs.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
FALSE_ALARM = 1e-6  # the chance that a correct evaluation fails a whole comparison


def reduction_path(config: dict, context: int) -> int:
    """The summed length of the reductions between the embeddings and one logit (point 3)."""
    d = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // heads
    per_layer = d + head_dim + context + heads * head_dim + d + config["intermediate_size"]
    return config["num_hidden_layers"] * per_layer + d


def confidence(path: int, num_logits: int, false_alarm: float = FALSE_ALARM) -> float:
    """lambda with 2 * path * num_logits * exp(-lambda^2 / 2) <= false_alarm (point 4)."""
    return math.sqrt(2.0 * math.log(2.0 * path * num_logits / false_alarm))


@functools.lru_cache(maxsize=4)
def _reference_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@dataclass(frozen=True)
class LogitBound:
    """The per-logit rounding bound of one prompt's prefill, with the reference's logits."""

    logits: torch.Tensor  # the float32 reference (transformers), [positions, vocab]
    scale: torch.Tensor  # lambda * sqrt(n) * u * M_i: one evaluation's distance from exact

    def between_two(self) -> torch.Tensor:
        """How far two evaluations, each within the bound, may be apart."""
        return 2.0 * self.scale


def logit_bound(model_dir: str | Path, ids: list[int], dtype: torch.dtype = torch.float32):
    """The bound for prefilling `ids` on the checkpoint at `model_dir` in `dtype`, from
    transformers' float32 evaluation (whose hidden states give M_i; any accurate h gives the
    same M_i to a few digits)."""
    model = _reference_model(str(model_dir))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        h = out.hidden_states[-1][0]  # after the final RMSNorm (transformers' Llama)
        magnitude = h.abs() @ model.lm_head.weight.abs().T
    path = reduction_path(config, len(ids))
    lam = confidence(path, magnitude.numel())
    scale = lam * math.sqrt(path) * UNIT_ROUNDOFF[dtype] * magnitude
    return LogitBound(out.logits[0].float(), scale)


def assert_logits_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor):
    """Every |actual - expected| <= bound, elementwise; the message says by how much not."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs()
    ratio = diff / bound.double()
    worst = int(ratio.argmax())
    over = int((ratio > 1).sum())
    assert over == 0, (
        f"{over} of {ratio.numel()} logits past the rounding bound; worst at flat index "
        f"{worst}: |diff| {diff.flatten()[worst]:.3e} against a bound of "
        f"{bound.flatten()[worst]:.3e} ({ratio.flatten()[worst]:.1f}x)"
    )
    return float(ratio.max())


@dataclass(frozen=True)
class GreedyReference:
    """transformers' greedy continuation of each prompt, with each step's top-two margin and
    the rounding bound on that margin (the two logits' bounds added)."""

    tokens: list[list[int]]
    margins: list[list[float]]
    margin_bounds: list[list[float]]

    def select(self, indices: list[int], max_tokens: int | None = None) -> GreedyReference:
        """The reference of some of the prompts, over their first `max_tokens` steps."""
        end = slice(None, max_tokens)
        return GreedyReference(
            [self.tokens[i][end] for i in indices],
            [self.margins[i][end] for i in indices],
            [self.margin_bounds[i][end] for i in indices],
        )


def greedy_reference(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int):
    """Greedy decoding with transformers in float32, step by step from the whole context (so
    every step's hidden state, and with it the bound, is at hand)."""
    model = _reference_model(str(model_dir))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head = model.lm_head.weight.abs()
    tokens, margins, bounds = [], [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                output_scores=True,
                output_hidden_states=True,
            )
            new = out.sequences[0][len(prompt) :].tolist()
            seq_m, seq_b = [], []
            for step, (scores, hidden) in enumerate(zip(out.scores, out.hidden_states)):
                h = hidden[-1][0, -1]  # the normed state of the position that chose `step`
                top = scores[0].float().topk(2)
                magnitude = head[top.indices] @ h.abs()
                path = reduction_path(config, len(prompt) + step)
                lam = confidence(path, scores.shape[-1] * max_new_tokens * len(prompts))
                scale = lam * math.sqrt(path) * UNIT_ROUNDOFF[torch.float32]
                seq_m.append(float(top.values[0] - top.values[1]))
                # each of the two evaluations (ours, the reference) within its bound, two logits
                seq_b.append(float(2.0 * scale * magnitude.sum()))
            tokens.append(new)
            margins.append(seq_m)
            bounds.append(seq_b)
    return GreedyReference(tokens, margins, bounds)


def assert_greedy_agrees(outputs: list[list[int]], reference: GreedyReference) -> int:
    """Each output equals the reference's tokens up to its end, or up to a step where the
    reference's choice was a near-tie (its margin within rounding), after which the two may
    part. Returns how many outputs parted at a near-tie."""
    assert len(outputs) == len(reference.tokens)
    parted = 0
    for i, (ours, ref) in enumerate(zip(outputs, reference.tokens)):
        k = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if k is None:
            assert len(ours) == len(ref), f"output {i}: {len(ours)} tokens, reference {len(ref)}"
            continue
        margin, bound = reference.margins[i][k], reference.margin_bounds[i][k]
        assert margin <= bound, (
            f"output {i} parts from the reference at token {k} ({ours[k]} for {ref[k]}), where "
            f"the reference's top-two margin {margin:.3e} exceeds rounding's {bound:.3e}"
        )
        parted += 1
    return parted


def chunked_logits(model, ids: list[int], size: int) -> torch.Tensor:
    """transformers' logits (float32) of a prefill of `ids` in chunks of `size` through its
    KV cache: the same model summed in another order than one whole prefill."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(), []
    with torch.inference_mode():
        for i in range(0, len(ids), size):
            out = model(torch.tensor([ids[i : i + size]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0].float())
    return torch.cat(rows)


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
