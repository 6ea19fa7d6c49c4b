"""Algorithm 3: how long a prefill of L tokens takes on an otherwise idle replica.

One isolated prefill of the longest allowed prompt is walked chunk by chunk, with exactly the
chunk sizes the packer would choose; the chunk boundaries form the grid. A prompt of L tokens
follows the same chunks up to the last boundary below L and then runs one shorter chunk, which
is evaluated exactly: interpolating across it would hide the fixed cost of an iteration, and
short requests live entirely inside the first chunk.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable

from medha.perf.predictor import Predictor

# (kv_offset, remaining tokens) -> chunk size the packer would run alone
ChunkPlanner = Callable[[int, int], int]


class PrefillTimeCache:
    def __init__(self, predictor: Predictor, plan_chunk: ChunkPlanner, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self._p = predictor
        self.max_len = max_len
        spp = predictor.parallel.spp
        # With SPP the next chunk enters stage 1 as soon as the previous leaves it, so a chunk
        # costs one stage time; the last one also has to drain through the other stages.
        self._stage_share = 1.0 / spp
        self.boundaries = [0]
        self.cumulative_s = [0.0]
        self.chunks: list[int] = []
        k, t = 0, 0.0
        while k < max_len:
            n = plan_chunk(k, max_len - k)
            if n < 1:
                raise RuntimeError(f"chunk planner returned {n} at offset {k}")
            t += self._chunk_time(n, k) * self._stage_share
            k += n
            self.chunks.append(n)
            self.boundaries.append(k)
            self.cumulative_s.append(t)

    def _chunk_time(self, n: int, k: int) -> float:
        p = self._p
        return p.linear_time(n, 1) + p.prefill_attention_time(n, k)

    def time(self, num_tokens: int) -> float:
        """Predicted seconds to prefill `num_tokens` tokens alone (0 for 0)."""
        if num_tokens <= 0:
            return 0.0
        if num_tokens > self.max_len:
            raise ValueError(f"{num_tokens} tokens exceed the cache's max_len {self.max_len}")
        i = bisect_right(self.boundaries, num_tokens) - 1
        start = self.boundaries[i]
        done = self.cumulative_s[i]
        if start == num_tokens:  # ends on a boundary: the last chunk was a full one
            last = self.chunks[i - 1]
            return done + self._chunk_time(last, start - last) * (1 - self._stage_share)
        last = self._chunk_time(num_tokens - start, start)
        return done + last  # the final partial chunk: one stage time plus the drain

    def remaining(self, total: int, done: int) -> float:
        """w_r(t): predicted prefill time still ahead of a request with `done` of `total`."""
        return max(0.0, self.time(total) - self.time(done))
