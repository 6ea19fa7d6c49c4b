"""A predictor corrected online from the batches the engine runs (issue 48, item 2).

Whatever model the engine starts with (the roofline of its hardware, or a profile taken on a
quiet machine or over another context range) is off the engine as it runs now by a few
factors that the batch's shape separates: a fixed cost per step (launches, Python, sampling),
a cost per sequence, the token-parallel work (weights read, GEMMs), the attention of prefill
chunks over their KV prefix, and the attention of decodes. `CorrectedPredictor` keeps its base
model's split and scales each part by a coefficient,

    time = f + s * num_seqs + alpha * base.linear_time + beta * base.prefill_attention
           + gamma * base.decode_attention,

so the packer's O(1) probes (`BatchTimer`) keep working, and `StepLearner` fits
theta = (f, s, alpha, beta, gamma) to the measured step times: weighted least squares on the
relative error (a 10 ms step off by 5 ms counts as much as a 1 s step off by 0.5 s), every
coefficient >= 0, with a prior that the base model is right (worth `prior_batches` batches)
and a forgetting factor per batch, so that
the fit follows a machine whose speed changes (other load beside it) and is deterministic: it
counts batches, not seconds. The simulator never attaches a learner: its predictor is the
truth there and does not drift.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from medha.perf.predictor import Predictor, WrappedPredictor

# theta's parts, and the base model's own: nothing fixed or per sequence beyond the base's, each
# of its parts at its own weight
NAMES = ("fixed_s", "per_seq_s", "linear", "prefill_attention", "decode_attention")
BASE_THETA = (0.0, 0.0, 1.0, 1.0, 1.0)
# the decode batch whose time sets the scale of the fixed and per-sequence costs in the prior
REF_SEQS = 32
# the most lone-chunk shapes whose base times a CorrectedPredictor keeps (a walk of a
# million-token prompt visits tens of thousands)
STEP_PARTS_KEPT = 1 << 16


class _StepParts:
    """A base predictor's two parts of lone chunks' steps, by KV offset, then chunk: each as
    complex(linear, attention), which holds both numbers exactly. Ints, complex numbers and
    dicts of only those are no objects for Python's garbage collector to track, where a table
    keyed by (chunk, offset) tuples kept two tracked tuples a shape: a cold resolution of the
    defaults keeps thousands, and on vLLM's engine core every tracked object kept counts
    towards the next collection, which lands inside whatever allocates next (issue 69: 0.5-0.8
    ms collections inside a resolution's slice, the largest of medha's steps)."""

    __slots__ = ("rows", "size")

    def __init__(self) -> None:
        self.rows: dict[int, dict[int, complex]] = {}
        self.size = 0  # shapes kept (at most STEP_PARTS_KEPT)

    def add(self, base: Predictor, num_tokens: int, kv_offset: int) -> complex:
        if self.size >= STEP_PARTS_KEPT:
            self.rows.clear()
            self.size = 0
        parts = complex(
            base.linear_time(num_tokens, 1), base.prefill_attention_time(num_tokens, kv_offset)
        )
        row = self.rows.get(kv_offset)
        if row is None:
            row = self.rows[kv_offset] = {}
        row[num_tokens] = parts
        self.size += 1
        return parts


class CorrectedPredictor(WrappedPredictor):
    """`inner`'s times with each part scaled by the fitted coefficients `theta`. The object stays
    the same as the fit moves (`version` counts the changes), so everyone holding it (batch
    timers, packers, the prefill-time walk) reads the corrected model; tables derived from it
    must be rebuilt when `version` changes."""

    name = "corrected"

    def __init__(self, inner: Predictor) -> None:
        super().__init__(inner)
        self.theta: tuple[float, float, float, float, float] = BASE_THETA
        self.version = 0
        # the base's two parts of a lone chunk's step: the base never changes, theta does, and
        # after each correction the prefill-time walk and the requests' prices ask the same
        # shapes again (issue 69: a repricing of 130 waiting requests spent two thirds of its
        # time in the base, on a vLLM step). Shared by snapshots.
        self._step_parts = _StepParts()

    def set_theta(self, theta: Sequence[float]) -> None:
        theta = tuple(float(x) for x in theta)
        if len(theta) != len(NAMES) or any(not x >= 0 for x in theta):
            raise ValueError(f"theta must be {len(NAMES)} numbers >= 0, got {theta!r}")
        if theta != self.theta:
            self.theta = theta
            self.version += 1

    def snapshot(self) -> CorrectedPredictor:
        """A copy of the model as it stands (the same base, this theta), which the fit does not
        move."""
        copy = CorrectedPredictor(self.inner)
        copy.set_theta(self.theta)
        copy._step_parts = self._step_parts
        return copy

    def prefill_step_time(self, num_tokens: int, kv_offset: int) -> float:
        """`Predictor.prefill_step_time` (the same sum, in the same order), the base's parts
        kept (`_step_parts`)."""
        row = self._step_parts.rows.get(kv_offset)
        parts = None if row is None else row.get(num_tokens)
        if parts is None:
            parts = self._step_parts.add(self.inner, num_tokens, kv_offset)
        f, s, alpha, beta, _ = self.theta
        return f + s * 1 + alpha * parts.real + beta * parts.imag

    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        f, s, alpha, _, _ = self.theta
        return f + s * num_seqs + alpha * self.inner.linear_time(num_tokens, num_seqs)

    def prefill_attention_time(self, num_tokens: int, kv_offset: int) -> float:
        return self.theta[3] * self.inner.prefill_attention_time(num_tokens, kv_offset)

    def decode_attention_time(self, kv_len: int) -> float:
        return self.theta[4] * self.inner.decode_attention_time(kv_len)

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        return self.theta[4] * self.inner.decode_attention_total(kv_lens)

    def features(
        self, prefills: Iterable[tuple[int, int]], decode_kv_lens: Sequence[int]
    ) -> tuple[float, float, float, float, float]:
        """phi of a batch given as (chunk, kv_offset) pairs and decode KV lengths: its time is
        the dot product of phi and theta."""
        inner = self.inner
        num_tokens, num_seqs, prefill_attention = len(decode_kv_lens), len(decode_kv_lens), 0.0
        for n, k in prefills:
            num_tokens += n
            num_seqs += 1
            prefill_attention += inner.prefill_attention_time(n, k)
        linear = inner.linear_time(num_tokens, num_seqs) if num_seqs else 0.0
        decode = inner.decode_attention_total(list(decode_kv_lens)) if decode_kv_lens else 0.0
        return (1.0, float(num_seqs), linear, prefill_attention, decode)

    def describe(self) -> str:
        parts = ", ".join(f"{n}={v:.4g}" for n, v in zip(NAMES, self.theta))
        return f"{self.inner.describe()}, corrected online ({parts})"


def probe_shapes(max_context: int) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """A lone decode, a decode batch, chunks short and long, alone and after a KV prefix, a
    chunk beside decodes (within `max_context`)."""
    top = max(64, min(max_context, 1 << 17))
    chunk, ctx = min(2048, top // 2), min(1024, top // 2)
    return [
        ([], [ctx]),
        ([], [ctx] * 32),
        ([(32, 0)], []),
        ([(chunk, 0)], []),
        ([(chunk, top - chunk)], []),
        ([(chunk // 4, top // 2)], [ctx] * 8),
    ]


class StepLearner:
    """Fits a CorrectedPredictor's theta to the measured time of each batch it is shown.

    `prior_batches`: how much the prior that the base model is right weighs, in batches each
    100% off on a part of the step alone: small, a ridge that settles the parts no batch has
    spoken for yet (a part such as a chunk's attention is a few percent of most steps, so each
    batch tells little of it, and even one batch's worth of prior held it back for hundreds);
    `forget`: each batch's weight is multiplied by this at every later one (0.98: about the
    last 50 batches count); `outlier`: a batch measured this many times its prediction, once
    `settled` batches have been seen, counts a quarter (a stall, a page fault, a machine
    hiccup must not move the model much)."""

    def __init__(
        self,
        predictor: CorrectedPredictor,
        prior_batches: float = 0.01,
        forget: float = 0.98,
        outlier: float = 2.0,
        settled: int = 8,
    ) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget must lie in (0, 1], got {forget!r}")
        self.predictor = predictor
        self.forget = forget
        self.outlier = outlier
        self.settled = settled
        self.observed = 0
        k = len(NAMES)
        self._gram = [[0.0] * k for _ in range(k)]  # sum of w phi phi^T, forgotten over time
        self._rhs = [0.0] * k  # sum of w phi y
        # the prior, that the base model is right: a penalty on the distance of its parts'
        # weights from 1 (`prior_batches`), never forgotten, so that a part no batch has
        # spoken for keeps the base's weight. The fixed and per-sequence
        # costs get only a token one (1e-6 of it, against the time of a typical decode batch):
        # the base prices what it knows of them already, and a prior at 0 would hold back the
        # one correction every engine needs (its launches and Python on every step).
        ref_s = max(predictor.inner.shape_time((), [1024] * REF_SEQS), 1e-9)
        scales = (1e-6 / ref_s**2, 1e-6 * (REF_SEQS / ref_s) ** 2, 1.0, 1.0, 1.0)
        self._prior_diagonal = [prior_batches * c for c in scales]  # (a ridge: diagonal)
        self._prior_rhs = [prior_batches * c * t for c, t in zip(scales, BASE_THETA)]
        # the probe shapes' features: each probe's time is their dot product with theta, which
        # every learned batch asks (`moved`) and a dozen model evaluations a probe would cost
        # 0.05 ms of a step at 256 decodes on vLLM's engine core
        self._probe_features = [
            predictor.features(prefills, decodes)
            for prefills, decodes in probe_shapes(predictor.model.max_context)
        ]
        self._free: list[int] = []  # the coefficients the last fit left above 0
        self._acknowledged = self.probe_times()

    def probe_times(self) -> list[float]:
        """The corrected model's times of the probe shapes (a lone decode, a decode batch,
        chunks short and long, alone, after a KV prefix and beside decodes): what the
        scheduler checks to tell whether its tables must follow the correction."""
        theta = self.predictor.theta
        return [sum(a * b for a, b in zip(phi, theta)) for phi in self._probe_features]

    def moved(self, threshold: float = 0.03) -> bool:
        """Whether a probe's time moved more than `threshold` (relative) since the last call
        that said so (or since the start): then the tables derived from the model (the
        prefill-time walk, the requests' predicted work) are out of date."""
        now = self.probe_times()
        if any(abs(a / b - 1) > threshold for a, b in zip(now, self._acknowledged) if b > 0):
            self._acknowledged = now
            return True
        return False

    def observe(
        self,
        prefills: Iterable[tuple[int, int]],
        decode_kv_lens: Sequence[int],
        measured_s: float,
    ) -> bool:
        """Take one batch (its chunks as (num_tokens, kv_offset), its decodes' KV lengths) and
        its measured time; refit. Returns whether theta changed."""
        if not measured_s > 0 or measured_s == float("inf"):
            return False
        p = self.predictor
        phi = p.features(list(prefills), decode_kv_lens)
        if phi[1] == 0:
            return False  # an empty batch says nothing of the model
        weight = 1.0
        predicted = sum(a * b for a, b in zip(phi, p.theta))
        if self.observed >= self.settled and predicted > 0:
            ratio = measured_s / predicted
            if ratio > self.outlier or ratio < 1 / self.outlier:
                weight = 0.25
        _forget_and_add(self._gram, self._rhs, self.forget, phi, measured_s, weight)
        self.observed += 1
        gram = [row[:] for row in self._gram]
        for i, ridge in enumerate(self._prior_diagonal):
            gram[i][i] += ridge
        rhs = [a + b for a, b in zip(self._rhs, self._prior_rhs)]
        before = p.version
        theta = nonnegative_least_squares(gram, rhs, self._free, p.theta)
        self._free = [i for i, v in enumerate(theta) if v > 0]
        p.set_theta(theta)
        return p.version != before


def _forget_and_add(gram, rhs, forget: float, phi, y: float, weight: float) -> None:
    """Weigh every earlier observation of the normal equations of the relative error,
    (phi.theta - y) / y, by `forget`, and add this one: one pass over each row (this runs on
    every step)."""
    w = weight / (y * y)
    for i, a in enumerate(phi):
        wa = w * a
        gram[i] = [g * forget + wa * b for g, b in zip(gram[i], phi)]
        rhs[i] = rhs[i] * forget + wa * y


def nonnegative_least_squares(
    gram: list[list[float]],
    rhs: list[float],
    guess: Sequence[int] = (),
    last: Sequence[float] | None = None,
) -> list[float]:
    """argmin over theta >= 0 of theta^T G theta - 2 rhs^T theta (the normal equations G, rhs).
    Coefficients whose feature was never seen stay 0.

    The objective is convex, so a point that satisfies the KKT conditions is the minimum: the
    unconstrained minimum over a set of free coefficients, feasible, where no coefficient held
    at 0 would lower the objective by growing. Tried first: `guess` (the free set of the last
    fit, which a new step rarely changes), then every seen coefficient free (every part of the
    model positive); each is one k x k solve. Else Lawson and Hanson's active-set method
    (`_active_set`), a few solves more: a step's learning must stay well under a millisecond
    at 256 decodes on vLLM's engine core, where trying every free set (2^k - 1 solves) took
    0.4-0.7 ms (issue 69). (The order does not change the answer: with a ridge the minimum is
    unique, and either shortcut finds it or nothing. The guess goes first since a learner's
    model often holds a part at 0 for good, where every seen one free costs a solve more.)
    The active-set method starts from the first of them that is feasible, or from `last` (the
    last fit, 0 outside `guess`): a guess one coefficient off then takes a solve or two more,
    not one for each part."""
    seen = [i for i in range(len(rhs)) if gram[i][i] > 0]
    guessed = [i for i in guess if i in seen]
    start: tuple[list[int], list[float]] | None = None
    for free in (guessed, seen) if guessed != seen else (seen,):
        theta = _minimum_over(gram, rhs, free)
        if theta is None:
            continue
        if not any(i not in free and _descends(gram, rhs, theta, i) for i in seen):
            return theta  # the KKT conditions hold
        if start is None and free is guessed and all(theta[i] > 0 for i in free):
            start = (free, theta)  # (a warm start: each free coefficient above 0)
    if start is None and last is not None and guessed and all(last[i] > 0 for i in guessed):
        start = (guessed, [last[i] if i in guessed else 0.0 for i in range(len(rhs))])
    return _active_set(gram, rhs, seen, *(start or ()))


def _minimum_over(gram: list[list[float]], rhs: list[float], free: list[int]) -> list[float] | None:
    """The unconstrained minimum with the coefficients outside `free` at 0, if it is feasible
    (none below 0)."""
    if not free:
        return None
    x = _solve([[gram[i][j] for j in free] for i in free], [rhs[i] for i in free])
    if x is None or any(v < 0 for v in x):
        return None
    theta = [0.0] * len(rhs)
    for i, v in zip(free, x):
        theta[i] = v
    return theta


def _descends(gram: list[list[float]], rhs: list[float], theta: list[float], i: int) -> bool:
    """Whether growing coefficient i from theta lowers the objective (beyond rounding)."""
    terms = [g * t for g, t in zip(gram[i], theta) if t]
    slope = sum(terms) - rhs[i]  # half the objective's derivative in theta_i
    return slope < -1e-9 * (abs(rhs[i]) + sum(map(abs, terms)))


def _active_set(
    gram: list[list[float]],
    rhs: list[float],
    seen: list[int],
    free: Sequence[int] = (),
    theta: Sequence[float] | None = None,
) -> list[float]:
    """The constrained minimum by Lawson and Hanson's active-set method (Solving Least Squares
    Problems, 1974, ch. 23) on the normal equations: from theta = 0, free the coefficient whose
    growth lowers the objective most; solve over the free ones; where that leaves one below 0,
    move from theta toward the solution as far as every coefficient stays >= 0 and hold at 0
    those that reach it; repeat until no coefficient held at 0 would grow. Each pass frees one
    coefficient, so k = 5 takes a few solves. It may start instead from a feasible `theta`, 0
    outside the coefficients `free` (a warm start: it moves to the minimum over them first, as
    a pass does)."""
    k = len(rhs)
    if theta is None:
        theta, free = [0.0] * k, []
    else:
        theta, free = list(theta), list(free)
        if not _toward_minimum(gram, rhs, free, theta):
            theta, free = [0.0] * k, []  # (a singular start: from 0 after all)
    for _ in range(3 * k):  # (a bound, against rounding's cycles; never reached in the tests)
        held = [i for i in seen if i not in free and _descends(gram, rhs, theta, i)]
        if not held:
            break
        free.append(max(held, key=lambda i: rhs[i] - sum(g * t for g, t in zip(gram[i], theta))))
        if not _toward_minimum(gram, rhs, free, theta):
            free.pop()  # (a set this singular adds nothing: hold the newest back)
    return theta


def _toward_minimum(
    gram: list[list[float]], rhs: list[float], free: list[int], theta: list[float]
) -> bool:
    """One pass's inner loop, `free` and `theta` changed in place: the minimum over `free`;
    where it leaves one below 0, theta moves toward it as far as every coefficient stays >= 0,
    those that reach 0 leave `free`, and again. False where a solve is singular."""
    while free:
        z = _solve([[gram[i][j] for j in free] for i in free], [rhs[i] for i in free])
        if z is None:
            return False
        if all(v > 0 for v in z):
            for i, v in zip(free, z):
                theta[i] = v
            return True
        step = min(theta[i] / (theta[i] - v) for i, v in zip(free, z) if v <= 0)
        for i, v in zip(free, z):
            theta[i] += step * (v - theta[i])
        kept = [i for i in free if theta[i] > 0]
        for i in free:
            if i not in kept:
                theta[i] = 0.0
        free[:] = kept
    return True


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a (near-)singular system. (Written
    out for speed, up to 5 x 5 on every step: the first row of the largest pivot, as max()
    picks it.)"""
    n = len(b)
    scale = max([abs(x) for row in a for x in row], default=0.0)
    if scale == 0:
        return None
    tiny = 1e-12 * scale
    m = [row + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot, size = col, abs(m[col][col])
        for r in range(col + 1, n):
            if abs(m[r][col]) > size:
                pivot, size = r, abs(m[r][col])
        if size <= tiny:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        top = m[col]
        head = top[col]
        for r in range(col + 1, n):
            row = m[r]
            factor = row[col] / head
            if factor:
                row[col:] = [x - factor * y for x, y in zip(row[col:], top[col:])]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        x[r] = (row[n] - sum([row[c] * x[c] for c in range(r + 1, n)])) / row[r]
    return x
