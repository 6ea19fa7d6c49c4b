"""Fitted predictor: per-component models learned from measured timings.

Whatever the profile measured replaces the analytic estimate of that component; the rest stays
analytic (the bundled A100 tables, for instance, hold no attention kernels and no LM head).
`fitted_components` says which is which.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np

from medha.perf import setup_cache
from medha.perf.fitting import PiecewiseLinear, one_blas_thread
from medha.perf.hardware_specs import HardwareSpec
from medha.perf.model_specs import ModelSpec
from medha.perf.parallel_config import ParallelConfig
from medha.perf.profile_data import IterationRow, Profile, ProfileError
from medha.perf.roofline_predictor import RooflinePredictor


class ProfiledPredictor(RooflinePredictor):
    name = "profiled"

    def __init__(
        self, model: ModelSpec, hardware: HardwareSpec, parallel: ParallelConfig, profile: Profile
    ):
        super().__init__(model, hardware, parallel)
        self.profile = profile
        rows = (profile.op_rows, profile.collective_rows, profile.iteration_rows)
        self._profile_digest = hashlib.sha256(repr(rows).encode()).hexdigest()
        # Fitting takes seconds (hundreds of least-squares fits): the fits of the same profile
        # on the same layout come from the set-up cache when an earlier run stored them.
        path = setup_cache.path_for("profiled-fits", self.fingerprint())
        stored = setup_cache.read(path)
        if stored is None or not self._restore(stored):
            self._fit(profile, hardware, parallel)
            setup_cache.write(path, self._fits())

    @one_blas_thread
    def _fit(self, profile: Profile, hardware: HardwareSpec, parallel: ParallelConfig) -> None:
        tp = parallel.tp
        self._ops = self._fit_ops(profile, tp)
        self._all_reduce = self._fit_collective(
            profile, "all_reduce", tp, min(tp, hardware.devices_per_node)
        )
        inside = tp * parallel.spp <= hardware.devices_per_node
        self._send_recv = self._fit_collective(profile, "send_recv", 2, 2 if inside else 1)
        rows = [r for r in profile.iteration_rows if r.tp == tp]
        if profile.iteration_rows and not rows:
            raise ProfileError(
                f"profile {profile.sources} has iteration timings for tp in "
                f"{sorted({r.tp for r in profile.iteration_rows})}, not tp={tp}"
            )
        self._iteration = IterationModel.fit(rows) if rows else None
        if not (self._ops or self._iteration or self._all_reduce or self._send_recv):
            raise ProfileError(f"profile {profile.sources} holds no timings usable for tp={tp}")

    def _fits(self) -> dict:
        """The fitted models as JSON data (what the set-up cache stores)."""

        def line(f: PiecewiseLinear | None) -> list | None:
            return None if f is None else [f.knots, f.values]

        it = self._iteration
        return {
            "ops": {op: line(f) for op, f in self._ops.items()},
            "all_reduce": line(self._all_reduce),
            "send_recv": line(self._send_recv),
            "iteration": None
            if it is None
            else [
                it.knots,
                it.token_values,
                it.per_seq,
                it.attn_compute,
                it.attn_read,
                it.per_decode,
                it.decode_read,
            ],
        }

    def _restore(self, fits: dict) -> bool:
        """Take the models from `_fits()` data; False, changing nothing, if it is not that."""

        def line(x) -> PiecewiseLinear | None:
            if x is None:
                return None
            knots, values = x
            if not (
                isinstance(knots, list)
                and isinstance(values, list)
                and len(knots) == len(values) >= 1
            ):
                raise ValueError("not a fitted line")
            return PiecewiseLinear(knots, values)

        try:
            ops = {op: line(x) for op, x in fits["ops"].items()}
            all_reduce, send_recv = line(fits["all_reduce"]), line(fits["send_recv"])
            it = fits["iteration"]
            iteration = None if it is None else IterationModel(*it)
            if iteration is not None and len(iteration.knots) != len(iteration.token_values):
                raise ValueError("not a fitted iteration model")
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        self._ops, self._all_reduce, self._send_recv = ops, all_reduce, send_recv
        self._iteration = iteration
        return True

    @staticmethod
    def _fit_ops(profile: Profile, tp: int) -> dict[str, PiecewiseLinear]:
        by_op: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
        tps = set()
        for op, n, row_tp, seconds in profile.op_rows:
            tps.add(row_tp)
            if row_tp == tp:
                by_op[op][0].append(n)
                by_op[op][1].append(seconds)
        if tps and tp not in tps:
            raise ProfileError(
                f"profile {profile.sources} has op timings for tp in {sorted(tps)}, not tp={tp}"
            )
        return {op: PiecewiseLinear.fit(x, y) for op, (x, y) in by_op.items()}

    @staticmethod
    def _fit_collective(
        profile: Profile, kind: str, workers: int, per_node: int
    ) -> PiecewiseLinear | None:
        rows = [
            (b, s)
            for c, w, d, b, s in profile.collective_rows
            if c == kind and w == workers and d == per_node
        ]
        if not rows:
            return None
        x, y = zip(*rows)
        return PiecewiseLinear.fit(x, y)

    def fingerprint(self) -> dict | None:
        return {**super().fingerprint(), "profile": self._profile_digest, "fit": FIT_VERSION}

    def fitted_components(self) -> dict[str, str]:
        """component -> 'fitted' or 'analytic'."""
        if self._iteration is not None:
            return {
                "linear layers": "fitted (whole iterations)",
                "attention": "fitted (whole iterations)",
                "collectives": "fitted" if self._all_reduce else "analytic",
            }
        parts = {op: "fitted" for op in self._ops}
        parts["attention"] = "analytic"
        parts["lm_head"] = "analytic"
        parts["all_reduce"] = "fitted" if self._all_reduce else "analytic"
        parts["send_recv"] = "fitted" if self._send_recv else "analytic"
        return parts

    # ---- overrides ---------------------------------------------------------------------------
    def op_time(self, op: str, n: int) -> float:
        fit = self._ops.get(op)
        return fit(n) if fit is not None else super().op_time(op, n)

    def all_reduce_time(self, nbytes: float) -> float:
        if self.parallel.tp == 1 or self._all_reduce is None:
            return super().all_reduce_time(nbytes)
        return self._all_reduce(nbytes)

    def send_recv_time(self, nbytes: float) -> float:
        return self._send_recv(nbytes) if self._send_recv else super().send_recv_time(nbytes)

    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        if self._iteration is None:
            return super().linear_time(num_tokens, num_seqs)
        if num_tokens <= 0:
            return 0.0
        return self._iteration.linear(num_tokens, num_seqs)

    def prefill_attention_time(self, num_tokens: int, kv_offset: int) -> float:
        if self._iteration is None:
            return super().prefill_attention_time(num_tokens, kv_offset)
        return self._iteration.prefill_attention(num_tokens, kv_offset)

    def decode_attention_time(self, kv_len: int) -> float:
        if self._iteration is None:
            return super().decode_attention_time(kv_len)
        return self._iteration.decode_attention(kv_len)

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        if self._iteration is None:
            return super().decode_attention_total(kv_lens)
        it = self._iteration
        return it.per_decode * len(kv_lens) + it.decode_read * sum(kv_lens)


# the fitting rules' version, in the set-up cache's key: a changed rule refits stored profiles
FIT_VERSION = 2
# measured rows a knot of the token curve takes at least
ROWS_PER_KNOT = 4
# fits of the iteration model: one least-squares fit, then ROBUST_PASSES - 1 refits with the
# rows reweighted by how far the last fit left them (Huber's weights on the relative error)
ROBUST_PASSES = 3
HUBER_K = 1.345  # in robust standard deviations (1.4826 MAD): 95% efficiency on clean data
# a start-up grid's rows each within this relative error count fully, however tight the rest
MIN_SPREAD = 0.05


def robust_weights(rel_err: np.ndarray) -> np.ndarray:
    """Huber's weights for residuals `rel_err` (relative): 1 within HUBER_K robust standard
    deviations of zero (never tighter than MIN_SPREAD), falling as 1/|r| beyond."""
    spread = max(1.4826 * float(np.median(np.abs(rel_err))), MIN_SPREAD)
    r = np.abs(rel_err) / (HUBER_K * spread)
    return 1.0 / np.maximum(r, 1.0)


def iteration_features(rows: list[IterationRow]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's tokens (what the token curve reads) and the rest of its features: sequences,
    a chunk's attention compute n(k + n/2) and KV read (k + n), decodes and their KV."""
    tokens = np.array([sum(n for n, _ in r.prefills) + len(r.decode_kv) for r in rows], float)
    extra = np.array(
        [
            [
                len(r.prefills) + len(r.decode_kv),
                sum(n * (k + (n + 1) / 2) for n, k in r.prefills),
                sum(k + n for n, k in r.prefills),
                len(r.decode_kv),
                sum(r.decode_kv),
            ]
            for r in rows
        ],
        float,
    )
    return tokens, extra


def _rise_basis(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Columns whose nonnegative combination is a nondecreasing linear spline through `knots`:
    a constant (the value at the first knot), then each segment's rise as a ramp from 0 to 1
    across it, the last one unbounded (the spline goes on along its last segment)."""
    cols = [np.ones(len(x))]
    for j in range(1, len(knots)):
        ramp = (x - knots[j - 1]) / (knots[j] - knots[j - 1])
        cols.append(np.clip(ramp, 0.0, None if j == len(knots) - 1 else 1.0))
    return np.stack(cols, axis=1)


class IterationModel:
    """Whole-iteration time = f(tokens) + a*seqs + sum of per-chunk and per-decode attention,
    fitted jointly with non-negative coefficients, so that no extrapolation turns negative.

    Attention features follow the kernels: a chunk of n after k costs compute ~ n(k + n/2) and
    KV reads ~ (k + n); a decode over k reads k tokens of KV.
    """

    def __init__(
        self, knots, token_values, per_seq, attn_compute, attn_read, per_decode, decode_read
    ):
        self._tokens = PiecewiseLinear(knots, token_values)
        self.per_seq, self.attn_compute, self.attn_read = (
            float(per_seq),
            float(attn_compute),
            float(attn_read),
        )
        self.per_decode, self.decode_read = float(per_decode), float(decode_read)

    @property
    def knots(self) -> list[float]:
        return self._tokens.knots

    @property
    def token_values(self) -> list[float]:
        return self._tokens.values

    @classmethod
    def fit(cls, rows: list[IterationRow], num_knots: int = 12) -> IterationModel:
        """Least relative error, every coefficient >= 0, the token curve nondecreasing (a step
        with more tokens never costs less: its value at the first knot plus a nonnegative rise
        on each segment), and rows far off the fit weighed down (`robust_weights`): a start-up
        grid times each shape once, on a machine that may be busy, and one outlier must not
        bend the curve that every budget is derived from (issue 68)."""
        from scipy.optimize import nnls  # a second to import: fits from the set-up cache skip it

        if len(rows) < 8:
            raise ProfileError(f"need at least 8 measured iterations to fit, got {len(rows)}")
        tokens, extra = iteration_features(rows)
        # knots at measured token counts, so that every segment has rows at both its ends, and
        # a few rows to each (a grid cut short by its time fits a coarser curve)
        num_knots = max(2, min(num_knots, len(rows) // ROWS_PER_KNOT))
        knots = np.unique(np.quantile(tokens, np.linspace(0, 1, num_knots), method="nearest"))
        if len(knots) < 2:
            knots = np.array([0.0, max(1.0, tokens[0])])
        features = np.hstack([_rise_basis(tokens, knots), extra])
        y = np.array([r.seconds for r in rows])
        # Scale columns so that NNLS is well conditioned, then undo the scaling.
        a = features / y[:, None]
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
        weights = np.ones(len(y))
        for _ in range(ROBUST_PASSES):
            root = np.sqrt(weights)  # (weights on the squared errors)
            coef, _ = nnls(a * root[:, None] / scale, root)
            coef = coef / scale
            weights = robust_weights(features @ coef / y - 1)
        k = len(knots)
        return cls(knots, np.cumsum(coef[:k]), *coef[k:])

    def linear(self, num_tokens: int, num_seqs: int) -> float:
        return self._tokens(num_tokens) + self.per_seq * num_seqs

    def prefill_attention(self, n: int, k: int) -> float:
        return self.attn_compute * n * (k + (n + 1) / 2) + self.attn_read * (k + n)

    def decode_attention(self, kv_len: int) -> float:
        return self.per_decode + self.decode_read * kv_len
