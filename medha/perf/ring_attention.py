"""Context parallelism (ring attention): the time of one prefill whose tokens are split over
`degree` instances, each one tensor-parallel group priced by an ordinary `Predictor`.

This is both LoongServe's elastic sequence parallelism (one prefill iteration of a batch of
whole prompts over the instances the scheduler chose) and plain context parallelism (CP degree
p over TP-t groups: the SPP-versus-CP comparison of bench/sim/sim_spp_vs_cp.py).

The model, per layer (all layers alike, so the predictor's whole-model times divide by the
layer count):

- Token-parallel work (QKV/output projections, MLP, norms, the TP all-reduces) runs on each
  instance's slice of ceil(tokens / degree) tokens, all instances at once: the predictor's
  `linear_time` of that slice (it covers every layer, the embedding, the LM head on one row per
  prompt and the iteration's fixed cost).
- Attention runs as `degree` ring steps. With striped partitioning (token i on instance
  i mod degree) every (query slice, KV slice) pair is close to a causal triangle, so each step
  does the same work: one causal block of `tokens / degree` queries over as many keys, for
  each prompt of the batch (`prefill_attention_time(n / degree, 0)` per layer). The
  off-by-one of the striped mask (a block above or below the diagonal keeps or drops the
  diagonal itself) is ignored.
- While it computes step s, each instance sends the KV slice it holds to the next instance of
  the ring and receives the next one: 2 x kv_heads x head_dim x dtype bytes per token and
  layer, each TP rank its ceil(kv_heads / tp) heads, point to point at the per-device link
  rate (`link_bw` when the whole ring sits in one node, `internode_bw` when it crosses nodes:
  a ring runs at its slowest link) plus one link latency. A step lasts max(compute, transfer);
  the first step computes on the local slice and so overlaps the first transfer, the last
  step sends nothing: attention = (degree - 1) x max(block, transfer) + block, plus one
  attention-kernel launch per extra step.
- The transfer overlaps attention only: a layer's KV exists once its QKV projection ran, and
  the next layer's projections need this layer's attention output.

`striped=False` prices the plain ring instead (contiguous partitioning, ring attention as first
published): the instance holding the last slice attends, at every step after the first, to a
whole earlier slice without a mask (twice a causal block's work, m queries over m keys, priced
as the kernel of m queries after m / 2 cached tokens: the same FLOPs and nearly the same
bytes), while the others skip the masked blocks and wait for it at the next step; so each
step after the first lasts max(2 x block, transfer).

At degree 1 this is exactly the predictor's own prefill time of the batch (no transfer, one
block of the whole prompt). What is left out: load imbalance when tokens do not divide evenly
(the busiest instance's ceil is taken for the linear part only), the merge of the partial
softmax results (a rescale per step, fused into the kernel), and any memory for activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from medha.perf.predictor import Predictor


@dataclass(frozen=True)
class RingPrefillTime:
    """One ring prefill, broken down (seconds; attention and transfer all layers)."""

    degree: int
    inter_node: bool
    linear_s: float  # token-parallel work on the busiest instance's slice
    block_s: float  # one ring step's attention compute, all layers
    transfer_s: float  # one ring step's KV transfer, all layers
    attention_s: float  # the ring: (degree - 1) x max(block, transfer) + block (+ launches)

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s

    @property
    def exposed_transfer_s(self) -> float:
        """Transfer time the attention compute did not hide (striped ring)."""
        return (self.degree - 1) * max(0.0, self.transfer_s - self.block_s)


def ring_kv_bytes_per_token_layer(predictor: Predictor) -> float:
    """KV bytes of one token and one layer that one TP rank holds, hence sends per ring step."""
    m, tp = predictor.model, predictor.parallel.tp
    return 2 * math.ceil(m.num_kv_heads / tp) * m.head_dim * predictor.hardware.dtype_bytes


def ring_prefill_time(
    predictor: Predictor,
    prompt_lens: Sequence[int] | int,
    degree: int,
    inter_node: bool,
    striped: bool = True,
) -> RingPrefillTime:
    """Time of one prefill of whole prompts (`prompt_lens`, or one length) split over `degree`
    instances, each a TP group that `predictor` prices; `inter_node`: the ring crosses nodes;
    `striped`: striped partitioning (balanced causal work) or the plain contiguous ring."""
    lens = [prompt_lens] if isinstance(prompt_lens, int) else list(prompt_lens)
    if not lens or any(not isinstance(n, int) or n < 1 for n in lens):
        raise ValueError(f"prompt lengths must be positive integers, got {prompt_lens!r}")
    if not isinstance(degree, int) or degree < 1:
        raise ValueError(f"degree must be a positive integer, got {degree!r}")
    if predictor.parallel.spp != 1 or predictor.parallel.kvp != 1:
        raise ValueError(
            "ring attention runs over TP groups: the predictor must have spp = kvp = 1"
        )
    hw, layers = predictor.hardware, predictor.model.num_layers
    tokens = sum(lens)
    linear = predictor.linear_time(math.ceil(tokens / degree), len(lens))
    # one step's block per prompt: n/degree queries over n/degree keys, causal (striped)
    slices = [max(1, round(n / degree)) for n in lens]
    block = sum(predictor.prefill_attention_time(m, 0) for m in slices)
    # the critical step: a causal block (striped), or an unmasked one on the last instance
    step = block if striped else sum(predictor.prefill_attention_time(m, m // 2) for m in slices)
    if degree == 1:
        return RingPrefillTime(1, inter_node, linear, block, 0.0, block)
    bw, latency = (
        (hw.internode_bw, hw.internode_latency_s) if inter_node else (hw.link_bw, hw.link_latency_s)
    )
    slice_tokens = sum(n / degree for n in lens)
    transfer = layers * (latency + slice_tokens * ring_kv_bytes_per_token_layer(predictor) / bw)
    launches = layers * (degree - 1) * hw.kernel_overhead_s
    attention = (degree - 1) * max(step, transfer) + block + launches
    return RingPrefillTime(degree, inter_node, linear, block, transfer, attention)


def context_parallel_prefill_time(
    predictor: Predictor, prompt_lens: Sequence[int] | int, cp: int, striped: bool = True
) -> RingPrefillTime:
    """Plain context parallelism: `cp` TP groups placed node by node (a group of tp devices
    never straddles a node when tp divides the node), so the ring stays inside one node only
    when all cp x tp devices fit in it."""
    hw = predictor.hardware
    inter = cp > 1 and cp * predictor.parallel.tp > hw.devices_per_node
    return ring_prefill_time(predictor, prompt_lens, cp, inter, striped)
