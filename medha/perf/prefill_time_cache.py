"""Algorithm 3: how long a prefill of L tokens takes on a replica with no other prefill.

One isolated prefill of the longest allowed prompt is walked chunk by chunk, with exactly the
chunk sizes the packer gives it in iteration-budget steps (`Packer.plan_isolated`: what it
runs beside any decode or short prefill; alone, with nobody waiting on its steps, it may run
longer ones and finish sooner); the chunk boundaries form the grid. A prompt of L tokens
follows the same chunks up to the last boundary below L and then runs one shorter chunk, which
is evaluated exactly: interpolating across it would hide the fixed cost of an iteration, and
short requests live entirely inside the first chunk.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate

from medha.perf.predictor import Predictor

# (kv_offset, remaining tokens) -> chunk size the packer would run alone
ChunkPlanner = Callable[[int, int], int]
# the most answers kept by prompt length (a million-token context sees many lengths)
TIMES_KEPT = 4096


class PrefillTimeCache:
    """The walk runs on demand, only as far as the longest prompt asked about so far: a model
    may allow a million tokens, and a workload of short prompts needs the first chunks only.
    Each step is the one the whole walk would take (the planner sees the same remaining
    length), so every answer is the same as after a walk to `max_len`."""

    def __init__(
        self,
        predictor: Predictor,
        plan_chunk: ChunkPlanner,
        max_len: int,
        overlapped: bool = True,
    ) -> None:
        """`overlapped`: the chunks of one prefill overlap across pipeline stages (SPP); off
        (a microbatched pipeline), each chunk waits for the previous one to leave the last."""
        if max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self._p = predictor
        self._plan = plan_chunk
        self.max_len = max_len
        spp = predictor.parallel.spp if overlapped else 1
        # With SPP the next chunk enters stage 1 as soon as the previous leaves it, so a chunk
        # costs one stage time; the last one also has to drain through the other stages.
        # Without the overlap a chunk costs its whole time through all stages.
        self._stage_share = 1.0 / spp
        self.reset()

    def _walk_to(self, num_tokens: int) -> None:
        """Walk on until a chunk boundary reaches `num_tokens`."""
        k, t = self.boundaries[-1], self.cumulative_s[-1]
        while k < num_tokens:
            n = self._plan(k, self.max_len - k)
            if n < 1:
                raise RuntimeError(f"chunk planner returned {n} at offset {k}")
            t += self._chunk_time(n, k) * self._stage_share
            k += n
            self.chunks.append(n)
            self.boundaries.append(k)
            self.cumulative_s.append(t)

    def plan_with(self, plan_chunk: ChunkPlanner) -> None:
        """Walk with another chunk planner from now on (a packer of new budgets), from the
        start."""
        self._plan = plan_chunk
        self.reset()

    def reset(self) -> None:
        """Forget the walk: the predictor (or its correction) changed, so every chunk the
        packer would plan and its time may have; the next question walks again."""
        self.boundaries: list[int] = [0]
        self.cumulative_s: list[float] = [0.0]
        self.chunks: list[int] = []
        # the answers so far, by prompt length: the walk grows, but never moves an answer, and
        # a reset prices every request in prefill again, most of them of a few lengths (issue
        # 69: 0.4-1.8 ms of a vLLM step with 114 waiting, each asked twice)
        self._times: dict[int, float] = {}

    def walked(self) -> dict:
        """The walk so far, as JSON data (the simulator keeps it on disk)."""
        return {"chunks": self.chunks, "cumulative_s": self.cumulative_s}

    def restore(self, walked: dict) -> None:
        """Continue from `walked()` of a cache with the same predictor, planner and max_len.
        Raises ValueError, and changes nothing, when it is not such a walk."""
        chunks, cumulative = walked.get("chunks"), walked.get("cumulative_s")
        if not (
            isinstance(chunks, list)
            and isinstance(cumulative, list)
            and len(cumulative) == len(chunks) + 1
            and cumulative[0] == 0.0
            and all(type(n) is int and n > 0 for n in chunks)
            and all(type(t) is float for t in cumulative)
            and sum(chunks) <= self.max_len
        ):
            raise ValueError("not a walk of this prefill-time cache")
        self.chunks, self.cumulative_s = chunks, cumulative
        self.boundaries = [0, *accumulate(chunks)]
        self._times = {}

    def _chunk_time(self, n: int, k: int) -> float:
        return self._p.prefill_step_time(n, k)

    def time(self, num_tokens: int) -> float:
        """Predicted seconds to prefill `num_tokens` tokens alone (0 for 0)."""
        if num_tokens <= 0:
            return 0.0
        known = self._times.get(num_tokens)
        if known is None:
            if len(self._times) >= TIMES_KEPT:
                self._times.clear()
            known = self._times[num_tokens] = self._time(num_tokens)
        return known

    def _time(self, num_tokens: int) -> float:
        if num_tokens > self.max_len:
            raise ValueError(f"{num_tokens} tokens exceed the cache's max_len {self.max_len}")
        if num_tokens > self.boundaries[-1]:
            self._walk_to(num_tokens)
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
