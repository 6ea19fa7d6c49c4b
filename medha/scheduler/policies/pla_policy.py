"""PLA-Serve (She et al., 2026): prefill-length-aware scheduling on one replica.

A long prefill is compute-bound: it keeps the device's arithmetic busy, and every short prefill
that shares its batch waits for it. A short prefill is memory-bound: its time is mostly one read
of the weights, which a second short prompt in the same batch shares almost for free. PLA-Serve
therefore splits prefills at a length boundary L_m into two queues, never mixes the classes in
one batch (temporal disaggregation), and batches short prefills on purpose. Only the paper's
abstract was within reach; the rules below are our design from the issue's description:

- L_m: the prompt length at which batching stops paying, from the predictor: the shortest L for
  which two prefills of L tokens in one batch save less than `pla_batching_gain` of their time
  apart. At 0.25 (the default) that is halfway from memory-bound (a second prompt is free, the
  saving is 1/2) to compute-bound (it costs as much as the first, no saving); Llama-3-8B on one
  H100 gives about 230 tokens. `pla_boundary_tokens` sets it instead. A request is short while
  the context it has to prefill (prompt, plus outputs after a preemption) is below L_m.
- Which class runs: the short queue when its batch is ready (below), else the long queue. A
  long request whose slack falls below one iteration goes first all the same, unless a ready
  short batch holds an earlier deadline (no class starves the other). Decodes ride along with
  either class, as under fcfs; within a class, first come first served.
- Adaptive Wait-Depth (AWD) batching of short prefills: a bucket grid prices batches of b short
  prompts of length l (l up to L_m, b = 1, 2, 4, ..., 64) with the predictor. Short prefills go
  when D of them wait, or when the oldest has waited W, or earlier when the nearest deadline
  would otherwise be missed (deadline - batch time - one iteration budget). After each short
  dispatch W and D are re-estimated: D = the deepest grid size b with b <= 1 + lambda x
  cost(l, b) (the prompts that would arrive while one batch runs, i.e. that would queue behind
  it anyway), within the depth the grid says still pays (each doubling saves at least
  `pla_batching_gain`); W = (D - 1) / lambda, at most `pla_max_wait_s`. lambda is the short
  arrival rate and l the bucket of the mean short length (moving averages over dispatches). At
  low rates D = 1 and W = 0: shorts go at once.

While the policy holds short prefills and the replica has nothing else to run, `wake_at` tells
the executor when the window closes. Spatial disaggregation across replicas is the `pla`
dispatcher (medha/sim/dispatchers/pla_dispatcher.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from medha.core.config import PlaSettings, SchedulerConfig
from medha.core.request import Request
from medha.scheduler.policies.base_policy import POLICIES
from medha.scheduler.policies.fcfs_policy import FcfsPolicy

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.scheduler.block_manager import BlockManager

GRID_SIZES = (1, 2, 4, 8, 16, 32, 64)  # batch sizes of the AWD bucket grid
GRID_LENGTHS = 5  # length buckets: L_m, L_m/2, ..., L_m/16
EWMA = 0.2  # weight of the newest dispatch in the arrival-rate and length estimates
SHORT, LONG = "short", "long"


def prefill_time(predictor: Predictor, tokens: int, count: int = 1) -> float:
    """Predicted time of one batch holding `count` fresh prefills of `tokens` tokens each."""
    return predictor.shape_time([(tokens, 0)] * count)


def batching_gain(predictor: Predictor, tokens: int, count: int = 1) -> float:
    """Share of the time saved by running 2 x `count` prefills of `tokens` tokens in one batch
    rather than as two batches of `count` each."""
    apart = 2 * prefill_time(predictor, tokens, count)
    return 1 - prefill_time(predictor, tokens, 2 * count) / apart


def pla_boundary(settings: PlaSettings, predictor: Predictor, max_len: int) -> int:
    """L_m of a deployment: the settings' `boundary_tokens`, else `boundary_tokens` from the
    predictor (the policy and the pla dispatcher share it)."""
    return settings.boundary_tokens or boundary_tokens(predictor, settings.batching_gain, max_len)


def boundary_tokens(predictor: Predictor, min_gain: float, max_len: int) -> int:
    """L_m: the shortest prompt length at which batching two prefills saves less than
    `min_gain` (1: batching never pays, every prefill is long; max_len: it always pays)."""
    if batching_gain(predictor, 1) < min_gain:
        return 1
    if batching_gain(predictor, max_len) >= min_gain:
        return max_len
    lo, hi = 1, max_len  # gain(lo) >= min_gain > gain(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if batching_gain(predictor, mid) >= min_gain:
            lo = mid
        else:
            hi = mid
    return hi


class CostGrid:
    """Predicted batch times of b short prefills of l tokens, on a grid of (l, b) buckets."""

    def __init__(self, predictor: Predictor, boundary: int, min_gain: float, max_seqs: int) -> None:
        top = max(1, boundary - 1)  # the longest short prompt
        self.lengths = sorted({max(1, top >> i) for i in range(GRID_LENGTHS)})
        self.sizes = [b for b in GRID_SIZES if b <= max_seqs] or [1]
        self.cost = {
            (n, b): prefill_time(predictor, n, b) for n in self.lengths for b in self.sizes
        }
        self.max_depth = {n: self._max_depth(n, min_gain) for n in self.lengths}

    def _max_depth(self, length: int, min_gain: float) -> int:
        """The deepest batch whose every doubling still saved at least `min_gain`."""
        depth = self.sizes[0]
        for small, big in zip(self.sizes, self.sizes[1:]):
            if 1 - self.cost[length, big] / (2 * self.cost[length, small]) < min_gain:
                break
            depth = big
        return depth

    def bucket(self, tokens: float) -> int:
        """The smallest grid length that holds `tokens` (the longest one beyond the grid)."""
        return next((n for n in self.lengths if n >= tokens), self.lengths[-1])

    def time(self, tokens: float, count: int) -> float:
        """Batch time of `count` prompts of about `tokens` tokens, from the nearest buckets."""
        size = next((b for b in self.sizes if b >= count), self.sizes[-1])
        return self.cost[self.bucket(tokens), size] * max(1.0, count / size)


@dataclass
class Dispatch:
    """One short batch let go: when, how many, after how long, and why."""

    time_s: float
    depth: int
    waited_s: float
    reason: str  # depth, window or deadline


class AdaptiveWaitDepth:
    """When the short queue is ready to go, and the window W and depth D it waits for."""

    def __init__(
        self,
        grid: CostGrid,
        wait_s: float,
        depth: int,
        max_wait_s: float,
        iteration_budget_s: float,
        adaptive: bool,
    ) -> None:
        self.grid = grid
        self.wait_s, self.depth = wait_s, depth
        self.max_wait_s, self.iteration_budget_s = max_wait_s, iteration_budget_s
        self.adaptive = adaptive
        self.rate = 0.0  # short arrivals per second (EWMA of arrivals / EWMA of gaps)
        self._arrivals = self._gap_s = 0.0
        self._length = float(grid.lengths[-1])
        self._new = 0  # shorts seen since the last dispatch
        self._seen: set[str] = set()
        self._last_s: float | None = None
        self.dispatches: list[Dispatch] = []

    def observe(self, shorts: list[Request]) -> None:
        """Count the short prefills that joined the queue since the last call."""
        ids = {r.request_id for r in shorts}
        self._new += len(ids - self._seen)
        self._seen = ids

    def release_s(self, shorts: list[Request]) -> float:
        """The latest time the waiting shorts may go: the window after the oldest one arrived,
        or earlier if the nearest deadline would be missed (one iteration budget of margin,
        since a batch of the other class may be running when the time comes)."""
        oldest = min(r.arrival_s for r in shorts)
        length = sum(r.num_tokens - r.num_computed for r in shorts) / len(shorts)
        cost = self.grid.time(length, len(shorts))
        urgent = min(r.deadline_s for r in shorts) - cost - self.iteration_budget_s
        return min(oldest + self.wait_s, urgent)

    def reason(self, shorts: list[Request], now: float) -> str | None:
        """Why the shorts go now (depth, window, deadline), or None if they keep waiting."""
        if len(shorts) >= self.depth:
            return "depth"
        if now >= min(r.arrival_s for r in shorts) + self.wait_s:
            return "window"
        if now >= self.release_s(shorts):
            return "deadline"
        return None

    def dispatched(self, shorts: list[Request], now: float, reason: str) -> None:
        waited = now - min(r.arrival_s for r in shorts)
        self.dispatches.append(Dispatch(now, len(shorts), waited, reason))
        if self._last_s is not None and now > self._last_s:
            self._arrivals += EWMA * (self._new - self._arrivals)
            self._gap_s += EWMA * (now - self._last_s - self._gap_s)
            self.rate = self._arrivals / self._gap_s if self._gap_s > 0 else 0.0
        if self._last_s is None or now > self._last_s:
            self._new = 0
            self._last_s = now
        length = sum(r.num_tokens for r in shorts) / len(shorts)
        self._length += EWMA * (length - self._length)
        if self.adaptive:
            self._adapt()

    def _adapt(self) -> None:
        """D: the prompts expected while one batch of D runs, within the depth that pays;
        W: the time it takes them to arrive, at most max_wait_s."""
        length = self.grid.bucket(self._length)
        depth = 1
        for b in self.grid.sizes:
            if b > self.grid.max_depth[length] or b > 1 + self.rate * self.grid.cost[length, b]:
                break
            depth = b
        self.depth = depth
        self.wait_s = min(self.max_wait_s, (depth - 1) / self.rate) if depth > 1 else 0.0


@POLICIES.register("pla")
class PlaPolicy(FcfsPolicy):
    summary = (
        "PLA-Serve: short and long prefills (boundary L_m) in separate queues, one class "
        "per batch; short prefills batched by an adaptive wait and depth"
    )

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.boundary: int | None = None  # L_m, set by bind
        self.awd: AdaptiveWaitDepth | None = None
        self.iteration_budget_s = 0.0  # the scheduler's, set by bind
        self.last_class: str | None = None  # the class the last admit let through
        self._wake: float | None = None

    def bind(self, predictor: Predictor, blocks: BlockManager, max_model_len: int) -> None:
        config, settings = self.config, self.config.pla
        self.boundary = pla_boundary(settings, predictor, max_model_len)
        if not config.is_resolved:
            raise ValueError(
                "the pla policy needs a resolved config (SchedulerConfig.resolve), "
                "as ReplicaScheduler gives it"
            )
        # one iteration budget: the margin a deadline keeps for a batch of the other class
        self.iteration_budget_s = config.iteration_budget_s
        grid = CostGrid(predictor, self.boundary, settings.batching_gain, config.max_num_seqs)
        max_wait = settings.max_wait_s or self.iteration_budget_s
        self.awd = AdaptiveWaitDepth(
            grid,
            settings.wait_s,
            settings.depth,
            max_wait,
            self.iteration_budget_s,
            settings.adaptive,
        )

    def is_short(self, r: Request) -> bool:
        return r.num_tokens < self.boundary

    def wake_at(self) -> float | None:
        return self._wake

    def admit(
        self, queue: list[Request], is_live: Callable[[str], bool], now: float
    ) -> list[Request]:
        self._wake = None
        if self.awd is None:
            return queue  # not bound to a scheduler: plain fcfs
        self.awd.observe([r for r in queue if self.is_short(r)])
        # Requests whose every chunk is already running (pipelined batches) cannot run again;
        # counting them would pick a class with nothing to schedule.
        pending = [r for r in queue if r.num_scheduled < r.num_tokens]
        shorts = [r for r in pending if self.is_short(r)]
        longs = [r for r in pending if not self.is_short(r)]
        reason = self.awd.reason(shorts, now) if shorts else None
        if reason and not self._long_first(shorts, longs, now):
            self.awd.dispatched(shorts, now, reason)
            self.last_class = SHORT
            return shorts
        if longs:
            self.last_class = LONG
            return longs
        if shorts:
            self._wake = self.awd.release_s(shorts)
        self.last_class = None
        return []

    def _long_first(self, shorts: list[Request], longs: list[Request], now: float) -> bool:
        """A long request about to miss its deadline goes ahead of a ready short batch, unless
        a short one's deadline comes first."""
        if not longs:
            return False
        head = min(longs, key=lambda r: (r.arrival_s, r.admission_seq))
        if head.slack(now) >= self.iteration_budget_s:
            return False
        return head.deadline_s <= min(r.deadline_s for r in shorts)
