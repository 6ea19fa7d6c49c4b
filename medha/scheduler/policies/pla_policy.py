"""PLA-Serve (She et al.): prefill-length-aware scheduling on one prefill instance.

Prefills split at a length boundary into a short queue (memory-bound: batching them is nearly
free) and a long queue (compute-bound), and a batch never mixes the two (temporal
disaggregation). The pieces, each as the paper gives it (section 2.1, section 3, Algorithm 1):

- The boundary L_m (`LatencyModel`): T_comp(L, H) = a L (L + 2H) + b L and T_mem(L, H) =
  g_w L + g_r H for L new tokens over H tokens of history; L_m is where the two are equal,
  (g_w - b) / a for a first prefill, the root of a L^2 + (2aH + b - g_w) L - g_r H for a
  re-prefill. A request is short while its uncached tokens L are below L_m(H), H being what the
  prefix cache holds of its prompt (`calibrate` says where a, b, g_w, g_r come from).
- Adaptive Wait-Depth (`AdaptiveWaitDepth`): short prefills accumulate until the target depth
  D or the window W; early when the smallest slack DDL_i - (t + S) of the batch and the next
  request falls to sigma, or the head of the line has waited T_max. Grouped bucket-first (the
  head's length bucket, then shorter ones, then longer, under the token budget M), matched to
  the nearest captured CUDA-graph shape (the predictor pads the batch to it: graph_predictor.py).
  D starts at the deepest captured shape within M, W at clip(min_i(DDL_i - t - S)); after each
  dispatch of depth d reached after tau: W <- clip(tau) if d >= D, else D <- d.
- Modes (`PlaSettings.mode`): `sla` (default) takes W(t) = clip(min(W_SLA, W_GR)) at every
  decision, W_SLA = max(0, min_i(DDL_i - t - S) - delta), W_GR = max(0, D - depth) / max(r_s,
  eps) with r_s the short arrival rate; `awd` is Algorithm 1 alone (its own W); `token-max` is
  the deadline-free mode: a short batch goes once its padded tokens reach M_s (or T_max).
- One class per batch. Long prefills advance one request at a time, in chunks of the packer's
  size (C_l: `--chunking static:N`); `--pla-long-batch all` lets them share a batch instead
  (not the paper's: a reproduction run traces what the single-request rule costs). When both
  classes are ready the one holding the earlier deadline goes (SLA-first); in token-max mode
  short batches go first.

While short prefills wait and nothing else runs, `wake_at` tells the executor when to ask
again. Spatial disaggregation across instances is the `pla` dispatcher
(medha/dispatch/pla_dispatcher.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from medha.core.request import Request
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.policies.base_policy import POLICIES
from medha.scheduler.policies.config import PlaSettings
from medha.scheduler.policies.fcfs_policy import FcfsPolicy

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.scheduler.block_manager import BlockManager

SHORT, LONG = "short", "long"
# the paper's captured grid (section 3.1), used to align D when the cost model has no graphs
PAPER_LENGTHS = (8, 16, 32, 64, 128, 256)
PAPER_SIZES = (1, 2, 4, 8, 16, 32, 64)
EWMA = 0.2  # weight of the newest observation in the short arrival rate r_s


# ---- the compute-memory boundary (section 2.1) -----------------------------------------------
@dataclass(frozen=True)
class LatencyModel:
    """T_comp = alpha L (L + 2H) + beta L and T_mem = gamma_0 + gamma_w L + gamma_r H.

    gamma_0 is not in the paper (0 gives its formulas exactly): a prefill reads every weight
    once whatever its length, which the paper's per-token memory terms leave out; `calibrate`
    explains when it is kept."""

    alpha: float
    beta: float
    gamma_w: float
    gamma_r: float
    gamma_0: float = 0.0

    def t_comp(self, L: float, H: float = 0.0) -> float:
        return self.alpha * L * (L + 2 * H) + self.beta * L

    def t_mem(self, L: float, H: float = 0.0) -> float:
        return self.gamma_0 + self.gamma_w * L + self.gamma_r * H

    def boundary(self, H: float = 0.0) -> float:
        """L_m(H): memory-bound below, compute-bound above. The paper's L_m^prefill for H = 0
        and L_m^re-prefill otherwise (with gamma_0 = 0); gamma_0 joins g_r H as the constant
        term of the same quadratic."""
        a, c = self.alpha, self.gamma_0 + self.gamma_r * H
        lin = 2 * a * H + self.beta - self.gamma_w
        if c == 0:  # the first-turn prefill of the paper: (g_w - b) / a
            return max(0.0, -lin / a)
        return max(0.0, (-lin + math.sqrt(lin * lin + 4 * a * c)) / (2 * a))

    def saturation(self) -> float:
        """The limit of L_m for long histories: g_r / (2 a)."""
        return self.gamma_r / (2 * self.alpha)


def fit_latency_model(samples, memory_intercept: bool = True) -> LatencyModel:
    """Least squares of (L, H, T_comp, T_mem) samples onto the paper's two curves (with the
    constant gamma_0 in T_mem when `memory_intercept`)."""
    s = np.asarray(samples, dtype=float)
    L, H, tc, tm = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
    (alpha, beta), *_ = np.linalg.lstsq(np.column_stack([L * (L + 2 * H), L]), tc, rcond=None)
    cols = [L, H] + ([np.ones_like(L)] if memory_intercept else [])
    coef, *_ = np.linalg.lstsq(np.column_stack(cols), tm, rcond=None)
    return LatencyModel(
        float(alpha),
        float(beta),
        float(coef[0]),
        float(coef[1]),
        float(coef[2]) if memory_intercept else 0.0,
    )


SAMPLE_LENGTHS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SAMPLE_HISTORIES = (0, 512, 1024, 2048, 4096, 8192)


def roofline_split(predictor: Predictor, L: int, H: int) -> tuple[float, float]:
    """(compute, memory) seconds of one prefill of L tokens after H cached ones, each at the
    sustained rate the roofline gives its kernels: matmul and attention FLOPs at the GEMM and
    attention efficiencies; the weights read once, every GEMM's activations read and written,
    the new tokens' KV written and the history's KV read, at the memory efficiency."""
    m, hw = predictor.model, predictor.hardware
    b, tp = hw.dtype_bytes, predictor.parallel.tp
    compute = m.linear_flops(L) / tp / (hw.peak_flops * hw.gemm_eff) + m.attention_flops(
        L, H
    ) / tp / (hw.peak_flops * hw.attn_eff)
    h, q, kv, i = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
    acts = (h + q + 2 * kv) + (q + h) + (h + 2 * i) + (i + h)  # GEMM inputs and outputs
    per_token = m.num_layers * (acts + 2 * kv) * b / tp  # + the token's K and V
    history = m.num_layers * 2 * kv * b / tp
    weights = m.num_params * b / tp
    memory = (weights + per_token * L + history * H) / (hw.mem_bw * hw.mem_eff)
    return compute, memory


def calibrate(predictor: Predictor, memory_intercept: bool = True) -> LatencyModel:
    """a, b, g_w, g_r for this model and device, fitted the paper's way to samples of a single
    (re-)prefill at L = 8..4096 tokens over H = 0..8192, whose compute and memory times come
    from the model's shapes and the device's sustained rates (`roofline_split`): a physical
    calibration, not one to any measured latency.

    `memory_intercept` keeps the weights' read as gamma_0. The paper's T_mem has no constant;
    fitted without one to these samples, g_w falls below b (the matmuls' time per token), so
    L_m^prefill = max(0, (g_w - b) / a) is 0 and every first-turn prefill is compute-bound,
    against the 150-512 tokens the paper reports from profiling. With the weights' read as
    gamma_0, L_m is the roofline's crossover (about 230-330 tokens on an H100 or H200)."""
    samples = [
        (L, H, *roofline_split(predictor, L, H)) for L in SAMPLE_LENGTHS for H in SAMPLE_HISTORIES
    ]
    return fit_latency_model(samples, memory_intercept)


def hol_penalty(rate: float, p: float, rho: float, s_long: float, s_short: float) -> float:
    """The extra mean wait a unified FCFS queue adds when a share p of its jobs is short
    (Pollaczek-Khinchine): lambda p (1 - p) (S_l - S_s)^2 / (2 (1 - rho))."""
    return rate * p * (1 - p) * (s_long - s_short) ** 2 / (2 * (1 - rho))


# ---- Adaptive Wait-Depth (Algorithm 1, section 3.2 modes) -------------------------------------
def next_size(value: int, grid: tuple[int, ...]) -> int | None:
    return next((g for g in grid if g >= value), None)


@dataclass
class Dispatch:
    """One short batch let go: when, how deep, after how long, and why."""

    time_s: float
    depth: int
    waited_s: float
    reason: str  # depth, window, slack, hol, tokens (token-max) or backlog


class AdaptiveWaitDepth:
    """When the short queue goes, which of its requests, and the window W and depth D."""

    def __init__(
        self,
        settings: PlaSettings,
        service_s: Callable[[list[Request]], float],
        lengths: tuple[int, ...],
        sizes: tuple[int, ...],
        new_tokens: Callable[[Request], int] | None = None,
    ) -> None:
        """`service_s(batch)`: S, the predicted time of a batch; `new_tokens(r)`: L, what `r`
        has to prefill beyond its cached history (default: beyond what it holds now)."""
        self.s = settings
        self.new_tokens = new_tokens or _new_tokens
        self.mode = settings.mode
        self.service_s = service_s  # S: predicted time of a batch (padded to its graph)
        self.lengths, self.sizes = lengths, sizes
        self.M = settings.memory_tokens
        # D_0: the deepest captured shape whose memory (padded tokens, at the shortest
        # captured length) fits the budget M
        self.depth = max((b for b in sizes if b * lengths[0] <= self.M), default=1)
        self.window_s: float | None = None  # W, set from the deadlines at the first round
        self.rate = 0.0  # r_s: short arrivals per second (EWMA)
        self._last_arrival: float | None = None
        self._seen: set[str] = set()
        self.round_start: float | None = None
        self._last_dispatch = -math.inf
        self.dispatches: list[Dispatch] = []

    # ---- observation -------------------------------------------------------------------------
    def observe(self, shorts: list[Request]) -> None:
        """Update the short arrival rate from the requests new to the queue."""
        for r in sorted((r for r in shorts if r.request_id not in self._seen), key=_arrival):
            self._seen.add(r.request_id)
            if self._last_arrival is not None and r.arrival_s > self._last_arrival:
                gap = r.arrival_s - self._last_arrival
                self.rate += EWMA * (1 / gap - self.rate) if self.rate else 1 / gap
            self._last_arrival = max(self._last_arrival or r.arrival_s, r.arrival_s)
        self._seen &= {r.request_id for r in shorts}

    # ---- the batch ---------------------------------------------------------------------------
    def bucket(self, r: Request) -> int:
        n = self.new_tokens(r)
        return next_size(n, self.lengths) or n

    def group(self, shorts: list[Request]) -> list[Request]:
        """Bucket-first under the budget: the head of the line's length bucket (oldest first),
        then shorter buckets (longest first: the graph pads them to the batch's length), then
        longer ones (shortest first). A request joins while the batch stays within the deepest
        captured size and M padded tokens, and while running it in the batch costs no more
        than running it alone (S(B + r) <= S(B) + S(r), the predictor's times, graph-padded
        where a graph holds the batch): that is what keeps a 200-token prompt out of a batch
        of 8-token ones when padding would cost more than the launch it saves."""
        head = min(shorts, key=_arrival)
        hb = self.bucket(head)

        def rank(r: Request) -> tuple:
            b = self.bucket(r)
            return (0 if b == hb else 1 if b < hb else 2, abs(b - hb), _arrival(r))

        batch = [head]
        cost = self.service_s(batch)
        # the nearest candidates only (a deadline-free backlog holds thousands)
        near = sorted((r for r in shorts if r is not head), key=rank)[: 4 * self.sizes[-1]]
        for r in near:
            if len(batch) == self.sizes[-1]:
                break
            trial = batch + [r]
            if self.padded_tokens(trial) > self.M:
                continue
            together = self.service_s(trial)
            if together <= cost + self.service_s([r]):
                batch, cost = trial, together
        return batch

    def padded_tokens(self, batch: list[Request]) -> int:
        longest = max(self.bucket(r) for r in batch)
        return longest * (next_size(len(batch), self.sizes) or len(batch))

    # ---- when ---------------------------------------------------------------------------------
    def _start(self, shorts: list[Request]) -> float:
        """The round's timer: from the last dispatch, or the oldest short's arrival if later."""
        return max(self._last_dispatch, min(r.arrival_s for r in shorts))

    def window(self, batch: list[Request], shorts: list[Request], now: float) -> float:
        """W, measured from the round's start, within [W_min, W_max]: Algorithm 1's (from the
        deadlines at the first round, then tau); in the SLA mode the time waited so far plus
        min(W_SLA, W_GR) now; fixed at W_max when not adaptive."""
        s = self.s
        if not s.adaptive:
            return s.w_max_s
        S = self.service_s(batch)
        if self.window_s is None:  # Algorithm 1, line 1
            first = min(r.deadline_s for r in shorts) - now - S
            self.window_s = _clip(first, s.w_min_s, s.w_max_s)
        if self.mode == "sla":
            w_sla = max(0.0, min(r.deadline_s for r in shorts) - now - S - s.delta_s)
            w_gr = max(0, self.depth - len(batch)) / max(self.rate, s.rate_floor)
            w_t = _clip(now - self._start(shorts) + min(w_sla, w_gr), s.w_min_s, s.w_max_s)
            # the tighter of section 3.2's W(t) and Algorithm 1's W, which the fill times of
            # full batches adapt (`dispatched`)
            return min(w_t, self.window_s)
        return self.window_s

    def decide(self, shorts: list[Request], now: float) -> tuple[list[Request], str | None, float]:
        """(the batch, why it goes now or None, when it goes if nothing changes)."""
        batch = self.group(shorts)
        start = self._start(shorts)
        # compared as times, not as a wait against T_max: the wake-up this returns is hol_at,
        # and arrival + T_max - arrival can fall an ulp short of T_max, which would wake the
        # executor at hol_at to release nothing, again and again
        hol_at = min(r.arrival_s for r in shorts) + self.s.t_max_s
        if self.mode == "token-max":
            if self.padded_tokens(batch) >= self.s.token_max_tokens or len(batch) < len(shorts):
                return batch, "tokens", now
            return batch, ("hol" if now >= hol_at else None), hol_at
        if len(batch) < len(shorts):
            return batch, "backlog", now  # more wait than one batch holds: no reason to wait
        if len(batch) >= self.depth:
            return batch, "depth", now
        S = self.service_s(batch)
        slack = min(r.deadline_s for r in batch) - (now + S)
        if slack <= self.s.slack_s:
            return batch, "slack", now
        if now >= hol_at:
            return batch, "hol", now
        release = start + self.window(batch, shorts, now)
        if now >= release:
            return batch, "window", now
        # Wake when a bound that does not move closes the window: the SLA mode's group-rate
        # term counts from now and the rate changes only with arrivals (which wake the executor
        # anyway), so a wake-up for it would release nothing and move it on again, by ever
        # smaller steps when the rate is high.
        wake = min(self._window_closes(batch, shorts, start), hol_at, now + slack - self.s.slack_s)
        if wake <= now:  # a bound reached to within rounding: it goes now
            return batch, "window", now
        return batch, None, wake

    def _window_closes(self, batch: list[Request], shorts: list[Request], start: float) -> float:
        """When the window closes if no request arrives: W_max when not adaptive, Algorithm
        1's W, or in the SLA mode where W_SLA reaches 0 (within [W_min, W_max])."""
        s = self.s
        if not s.adaptive:
            return start + s.w_max_s
        if self.mode == "sla":
            latest = min(r.deadline_s for r in shorts) - self.service_s(batch) - s.delta_s
            return start + min(_clip(latest - start, s.w_min_s, s.w_max_s), self.window_s)
        return start + self.window_s

    def dispatched(self, batch: list[Request], shorts: list[Request], now: float, why: str) -> None:
        """Algorithm 1's update: W <- clip(tau) after a batch that reached D, else D <- d."""
        start = self._start(shorts)
        d, tau = len(batch), now - start
        self.dispatches.append(Dispatch(now, d, now - min(r.arrival_s for r in batch), why))
        if self.mode != "token-max" and self.s.adaptive:
            if d >= self.depth:
                self.window_s = _clip(tau, self.s.w_min_s, self.s.w_max_s)
            else:
                self.depth = d
        self._last_dispatch = now


def _clip(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def _arrival(r: Request) -> tuple[float, int]:
    return r.arrival_s, r.admission_seq


def _new_tokens(r: Request) -> int:
    return r.num_uncached_tokens


# ---- the policy --------------------------------------------------------------------------------
@POLICIES.register("pla")
class PlaPolicy(FcfsPolicy):
    pauses_steps = False  # (Policy.pauses_steps)
    summary = (
        "PLA-Serve: short and long prefills (boundary L_m(H)) in separate queues, one class "
        "per batch; short prefills batched by Adaptive Wait-Depth to captured graph shapes"
    )

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.model: LatencyModel | None = None
        self.awd: AdaptiveWaitDepth | None = None
        self.last_class: str | None = None
        self._wake: float | None = None
        self._peek: Callable[[Request], int] | None = None
        self._history: dict[str, int] = {}  # H of requests not yet attached to the cache

    def bind(self, predictor: Predictor, blocks: BlockManager, max_model_len: int) -> None:
        settings = self.config.pla
        self.model = calibrate(predictor, settings.memory_intercept)
        lengths = getattr(predictor, "lengths", ()) or PAPER_LENGTHS
        sizes = getattr(predictor, "sizes", ()) or PAPER_SIZES

        def service_s(batch: list[Request]) -> float:
            return predictor.shape_time([(self.new_tokens(r), self.history(r)) for r in batch])

        self.awd = AdaptiveWaitDepth(settings, service_s, lengths, sizes, self.new_tokens)

    def bind_prefix_cache(self, peek_cached: Callable[[Request], int]) -> None:
        self._peek = peek_cached

    # ---- classes -----------------------------------------------------------------------------
    def history(self, r: Request) -> int:
        """H: the prompt tokens the prefix cache holds for `r` (attached, or found by a look
        at its first sight in the queue)."""
        if r.num_cached_tokens or r.started or self._peek is None:
            return r.num_cached_tokens
        h = self._history.get(r.request_id)
        if h is None:
            h = self._history[r.request_id] = self._peek(r)
        return h

    def new_tokens(self, r: Request) -> int:
        """L: the tokens `r` prefills beyond its history H."""
        return r.num_tokens - self.history(r)

    def boundary(self, H: int = 0) -> float:
        fixed = self.config.pla.boundary_tokens
        return fixed if fixed else self.model.boundary(H)

    def is_short(self, r: Request) -> bool:
        H = self.history(r)
        return r.num_tokens - H < self.boundary(H)

    def wake_at(self) -> float | None:
        return self._wake

    def admit(
        self, queue: list[Request], is_live: Callable[[str], bool], now: float
    ) -> list[Request]:
        self._wake = None
        if self.awd is None:
            return queue  # not bound to a scheduler: plain fcfs
        if len(self._history) > 4 * len(queue) + 64:
            self._history = {
                r.request_id: self._history[r.request_id]
                for r in queue
                if r.request_id in self._history
            }
        # requests whose every chunk is already running (pipelined batches) cannot run again
        pending = [r for r in queue if r.num_scheduled < r.num_tokens]
        shorts, longs = [], []
        for r in pending:
            (shorts if self.is_short(r) else longs).append(r)
        self.awd.observe(shorts)
        batch, why, release = self.awd.decide(shorts, now) if shorts else ([], None, None)
        if why is not None and not self._long_first(batch, longs):
            self.awd.dispatched(batch, shorts, now, why)
            self.last_class = SHORT
            return batch
        if longs:
            self.last_class = LONG
            # one long request at a time, in chunks of C_l: under way first, then SLA-first
            started = [r for r in longs if r.started]
            key = (
                _arrival
                if self.awd.mode == "token-max"
                else (lambda r: (r.deadline_s, *_arrival(r)))
            )
            if self.config.pla.long_batch == "all":  # the option: longs batched together
                return sorted(longs, key=key)
            return [min(started or longs, key=key)]
        self._wake = release
        self.last_class = None
        return []

    def _long_first(self, batch: list[Request], longs: list[Request]) -> bool:
        """SLA-first between the classes: a long request due before every request of the ready
        short batch goes first (never in token-max mode, where short batches go first)."""
        if not longs or self.awd.mode == "token-max":
            return False
        return min(r.deadline_s for r in longs) < min(r.deadline_s for r in batch)
