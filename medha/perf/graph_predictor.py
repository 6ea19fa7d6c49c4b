"""The roofline predictor with the host's launch cost, and CUDA graphs for short prefill batches.

The plain roofline charges a small fixed cost per kernel and per iteration, as if the host
always issued kernels faster than the GPU ran them. For a short prefill batch on a fast GPU it
does not: an eager step launches every layer's kernels one by one from Python, and when the
GPU's work is a single read of the weights (a few milliseconds) the host's issue time sets the
step's time. A CUDA graph captured for the batch's shape replays all of them in one launch, at
the price of padding the batch to that shape. PLA-Serve's short-prefill batching lives on that
difference (She et al., section 3.1); this predictor prices it, so that whatever the pla
policy gains from it comes from the cost model.

- eager step: max(GPU time, host issue time) + the last layer's GPU time (its kernels are
  issued last, so they run after the host is done) + the iteration overhead (input
  preparation, sampling; the roofline's). Host issue time = layers x HOST_LAYER_S.
- graph step (`roofline-graph`, a batch of prefill chunks only, at most the largest captured
  depth, each chunk at most the longest captured length): the batch is padded to the smallest
  captured (L, B) that holds it (every chunk to L tokens, B sequences), its GPU time at that
  shape, plus one replay launch (GRAPH_LAUNCH_S) and the iteration overhead. Any other batch
  (decodes in it, a longer chunk, more sequences) runs eager, as in the paper.
- `roofline-graph-min`: an executor that replays the graph only where that is predicted
  faster than the eager step (otherwise the same).
- `roofline-eager` is the same cost model with no graphs captured: the baseline (SGLang and
  vLLM run prefills eagerly) and the pla policy without graphs.

Where the numbers come from (docs/cuda_graph_prefill_h100.json, measured by the compact script
docs/cuda_graph_prefill_h100_script.txt, sent inline to the lent H100;
bench/gpu/cuda_graph_prefill.py is the same measurement written out, with RoPE, not yet run): a
PyTorch decoder of Qwen2.5-7B's shapes (28 layers, bf16, random weights) on the H100, prefill
batches L in {8..256} x B in {1..64}, each timed eager and as a replayed CUDA graph:
- the host issued one eager forward in 6.78-7.59 ms whatever the shape (15.07 kernels per
  layer by torch.profiler, 16 us per kernel with PyTorch's per-op overhead; a bare launch
  costs 6.3 us): 244 us per layer -> HOST_LAYER_S;
- a replay was issued in 0.12-0.45 ms (0.16 ms at the short shapes) -> GRAPH_LAUNCH_S;
- the GPU time of a step is the roofline's in both modes (its 4 us a kernel kept for a
  replayed graph too). The measured graph left about 1 us between kernels, so this
  understates the graph's gain on host-bound shapes (eager / graph 1.06 predicted at L=8,
  B=1, 1.13 measured) and overstates it a little on GPU-bound ones (1.035 against 1.01 at
  256 x 64): the cautious side for a policy that gains from graphs;
- eager was 7.07 ms and the graph 6.13 ms at L=8, B=1 (host-bound), and both within 1-7% of
  each other from 16 x 64 tokens up (GPU-bound); docs/reproductions.md sets the model beside
  every measured shape.
- the captured grid: the paper's, L in {8, 16, 32, 64, 128, 256}, B in {1, 2, 4, 8, 16, 32,
  64}. The graphs' memory (the paper measures 228-277 MB each) is not taken from the KV cache.
"""

from __future__ import annotations

from bisect import bisect_left

from medha.perf.predictor import BatchTimer, Predictor
from medha.perf.roofline_predictor import RooflinePredictor

CAPTURED_LENGTHS = (8, 16, 32, 64, 128, 256)
CAPTURED_SIZES = (1, 2, 4, 8, 16, 32, 64)
HOST_LAYER_S = 244e-6  # host time to issue one decoder layer's kernels eagerly (measured)
GRAPH_LAUNCH_S = 160e-6  # host time to replay one captured graph (measured)


def next_captured(value: int, grid: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `value`, or None beyond the grid."""
    i = bisect_left(grid, value)
    return grid[i] if i < len(grid) else None


class EagerRooflinePredictor(RooflinePredictor):
    """The roofline with the host's eager launch cost; no CUDA graphs."""

    name = "roofline-eager"
    lengths: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    def fingerprint(self) -> dict | None:
        out = super().fingerprint()
        out.update(
            host_layer_s=HOST_LAYER_S,
            graph_launch_s=GRAPH_LAUNCH_S,
            lengths=list(self.lengths),
            sizes=list(self.sizes),
        )
        return out

    @property
    def host_issue_s(self) -> float:
        return self.model.num_layers * HOST_LAYER_S

    def eager_time(self, num_tokens: int, num_seqs: int, attention_s: float) -> float:
        if num_seqs == 0:
            return 0.0
        overhead = self.hardware.iteration_overhead_s
        gpu = self.linear_time(num_tokens, num_seqs) - overhead + attention_s
        return max(gpu, self.host_issue_s) + gpu / self.model.num_layers + overhead

    def graph_shape(self, longest: int, count: int) -> tuple[int, int] | None:
        """The captured (L, B) a batch of `count` prefill chunks of at most `longest` tokens
        pads to, or None when no captured graph holds it."""
        if not self.lengths or count == 0:
            return None
        length, size = next_captured(longest, self.lengths), next_captured(count, self.sizes)
        return None if length is None or size is None else (length, size)

    def graph_time(self, shape: tuple[int, int], kv_offsets: list[int]) -> float:
        """A step that replays the graph of `shape` holding prefill chunks after
        `kv_offsets` (the iteration overhead included)."""
        length, size = shape
        attention = sum(self.prefill_attention_time(length, k) for k in kv_offsets)
        return self.linear_time(length * size, size) + attention + GRAPH_LAUNCH_S

    def timer(self) -> BatchTimer:
        return GraphBatchTimer(self)


class GraphRooflinePredictor(EagerRooflinePredictor):
    """Eager launches, except batches of short prefills that fit a captured graph: padded to
    it whenever one holds them (the paper's Algorithm 1, lines 7-11)."""

    name = "roofline-graph"
    lengths = CAPTURED_LENGTHS
    sizes = CAPTURED_SIZES
    cheaper_only = False


class CheaperGraphRooflinePredictor(GraphRooflinePredictor):
    """The same, with an executor that replays a graph only when the padded replay is
    predicted faster than launching the batch eagerly (padding a compute-bound batch costs
    more than the launches it saves)."""

    name = "roofline-graph-min"
    cheaper_only = True


class GraphBatchTimer(BatchTimer):
    """Keeps the prefill chunks' lengths and offsets, to price the batch either way."""

    __slots__ = ("_decodes", "_kv", "_longest")

    def __init__(self, predictor: Predictor) -> None:
        super().__init__(predictor)
        self._decodes = 0
        self._kv: list[int] = []
        self._longest = 0

    def add_decode(self, kv_len: int) -> None:
        super().add_decode(kv_len)
        self._decodes += 1

    def add_decodes(self, kv_lens: list[int]) -> None:
        super().add_decodes(kv_lens)
        self._decodes += len(kv_lens)

    def add_prefill(self, num_tokens: int, kv_offset: int) -> None:
        super().add_prefill(num_tokens, kv_offset)
        self._kv.append(kv_offset)
        self._longest = max(self._longest, num_tokens)

    def _time(self, tokens: int, seqs: int, attention: float, longest: int, kv: list[int]):
        p: EagerRooflinePredictor = self._p  # type: ignore[assignment]
        shape = None if self._decodes else p.graph_shape(longest, len(kv))
        eager = p.eager_time(tokens, seqs, attention)
        if shape is None:
            return eager
        graph = p.graph_time(shape, kv)
        return min(graph, eager) if getattr(p, "cheaper_only", False) else graph

    def time(self) -> float:
        return self._time(self.num_tokens, self.num_seqs, self.attention_s, self._longest, self._kv)

    def time_with_prefill(self, num_tokens: int, kv_offset: int) -> float:
        p = self._p
        return self._time(
            self.num_tokens + num_tokens,
            self.num_seqs + 1,
            self.attention_s + p.prefill_attention_time(num_tokens, kv_offset),
            max(self._longest, num_tokens),
            [*self._kv, kv_offset],
        )
