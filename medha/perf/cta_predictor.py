"""The roofline predictor with decode attention bounded by its slowest thread block (roofline-cta).

The plain roofline prices a decode batch's attention as all its KV read at the device's
bandwidth. A paged-attention kernel reaches that bandwidth only while it has enough thread
blocks streaming; vLLM's (the baseline AlignedServe measures, Section 2.3) gives each (query
head, sequence) one thread block (CTA) that walks the sequence's KV alone (paged_attention_v1),
or, for contexts over 8192 or batches of at most 512 (head, sequence) pairs, one per 512-token
partition of it (v2). A CTA keeps a bounded number of bytes in flight, so by Little's law it
streams at most bytes_in_flight / memory latency, however idle the rest of the device is: a
batch's attention lasts at least as long as its longest CTA. This is the iteration-level bubble
AlignedServe targets, from how the kernel runs rather than from a padding assumption:

    attention(batch) = max(roofline sum over the batch, layers x longest CTA's bytes / CTA rate)

CTA rate: v1's 128 threads are 4 warps, each loading one 16-token KV block of one head
(16 x head_dim x dtype bytes) per step, so 4 blocks are in flight; HBM latency under load is
taken as 600 ns (microbenchmarks of A100/H100 global memory report 400-700 ns loaded; the value
is an assumption), 27.3 GB/s. `roofline-cta:GBPS` sets the rate instead: a v1-style Triton
kernel (one 4-warp program per (sequence, head), bench/gpu/aligned_attention_cuda.py) streamed
4.4 GB/s per program on an H100 (a 4696-token sequence alone: 545.6 us a layer), so a kernel of
this form can be six times slower per CTA than the Little's-law bound; vLLM's own kernel was not
at hand to measure. Nothing here is fitted to AlignedServe's figures.
"""

from __future__ import annotations

from medha.perf.padded_predictor import PaddedBatchTimer
from medha.perf.predictor import BatchTimer, Predictor
from medha.perf.roofline_predictor import RooflinePredictor

# vLLM paged attention: threads per CTA / 32, tokens per KV block, v2's partition, and when it
# runs v1 (csrc/attention and vllm/attention/ops/paged_attn.py)
WARPS_PER_CTA = 4
KV_BLOCK_TOKENS = 16
V2_PARTITION_TOKENS = 512
V1_MAX_CONTEXT = 8192
V1_MIN_PAIRS = 512
# loaded HBM latency (an assumption within published microbenchmarks; see the docstring)
MEMORY_LATENCY_S = 600e-9


class CtaRooflinePredictor(RooflinePredictor):
    name = "roofline-cta"

    def __init__(self, model, hardware, parallel, cta_gbps: float | None = None) -> None:
        """`cta_gbps`: one CTA's streaming rate in GB/s (default: by Little's law, above)."""
        super().__init__(model, hardware, parallel)
        m, hw, par = self.model, self.hardware, self.parallel
        in_flight = WARPS_PER_CTA * KV_BLOCK_TOKENS * m.head_dim * hw.dtype_bytes
        self.cta_bw = cta_gbps * 1e9 if cta_gbps else in_flight / MEMORY_LATENCY_S
        if cta_gbps is not None:
            self.name = f"roofline-cta:{cta_gbps:g}"
        self.heads = max(1, m.num_heads // par.tp)  # query heads per device: CTAs per sequence
        # one CTA's K and V of one token in all layers of this device's stage
        self._token_s = 2 * m.head_dim * hw.dtype_bytes * m.num_layers / par.spp / self.cta_bw

    def cta_tail(self, longest: int, num_seqs: int) -> float:
        """Seconds the longest CTA of a batch of `num_seqs` decodes, the longest over `longest`
        cached tokens, takes: its whole context under v1, a partition under v2."""
        k = longest + 1
        v1 = k <= V1_MAX_CONTEXT and (
            k <= V2_PARTITION_TOKENS or num_seqs * self.heads > V1_MIN_PAIRS
        )
        return (k if v1 else min(k, V2_PARTITION_TOKENS)) * self._token_s

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        if not kv_lens:
            return 0.0
        total = super().decode_attention_total(kv_lens)
        return max(total, self.cta_tail(max(kv_lens), len(kv_lens)))

    def timer(self) -> BatchTimer:
        return CtaBatchTimer(self)


class CtaBatchTimer(PaddedBatchTimer):
    """Keeps the decodes' roofline sum beside their count and longest (the padded timer's);
    their attention is the larger of the sum and the longest CTA."""

    __slots__ = ("_sum",)

    def __init__(self, predictor: Predictor) -> None:
        super().__init__(predictor)
        self._sum = 0.0

    def add_decodes(self, kv_lens: list[int]) -> None:
        super().add_decodes(kv_lens)
        if kv_lens:
            self._sum += RooflinePredictor.decode_attention_total(self._p, kv_lens)

    def _decode_s(self) -> float:
        if not self._decodes:
            return 0.0
        return max(self._sum, self._p.cta_tail(self._longest, self._decodes))
