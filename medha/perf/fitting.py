"""Small regression models fitted to measured timings.

Timings span four orders of magnitude, so every fit minimises relative error (rows weighted by
1/y): a 5 us kernel matters as much as a 50 ms one.
"""

from __future__ import annotations

import functools
import threading
from bisect import bisect_right
from collections.abc import Callable, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

_fitting = threading.local()


def one_blas_thread(fit: Callable) -> Callable:
    """Runs `fit` with one BLAS thread. A fit is many small least-squares solves, where BLAS
    threads only add hand-offs, and OpenBLAS's spinning threads make them an order of magnitude
    slower whenever anything else keeps a core busy, an engine included. Limited once at the
    outermost fit (setting the limit is not free)."""

    @functools.wraps(fit)
    def pinned(*args, **kwargs):
        if getattr(_fitting, "active", False):
            return fit(*args, **kwargs)
        _fitting.active = True
        try:
            with threadpool_limits(limits=1, user_api="blas"):
                return fit(*args, **kwargs)
        finally:
            _fitting.active = False

    return pinned


class PiecewiseLinear:
    """y(x) as a least-squares linear spline; constant below the first knot, linear beyond the
    last (GEMM and attention costs keep growing linearly past the measured range)."""

    def __init__(self, knots: Sequence[float], values: Sequence[float]) -> None:
        self.knots = [float(k) for k in knots]
        self.values = [float(v) for v in values]

    @classmethod
    @one_blas_thread
    def fit(
        cls, x: Sequence[float], y: Sequence[float], num_knots: int | None = None
    ) -> PiecewiseLinear:
        x_arr, y_arr = np.asarray(x, float), np.asarray(y, float)
        if len(x_arr) == 0:
            raise ValueError("cannot fit a model to zero rows")
        if num_knots is None:
            num_knots = _choose_num_knots(x_arr, y_arr)
        knots = np.unique(np.quantile(x_arr, np.linspace(0, 1, num_knots)))
        if len(knots) == 1:
            return cls(knots, [float(np.median(y_arr))])
        basis = _hat_basis(x_arr, knots)
        w = 1.0 / np.maximum(np.abs(y_arr), 1e-12)
        coef, *_ = np.linalg.lstsq(basis * w[:, None], y_arr * w, rcond=None)
        return cls(knots, coef)

    def __call__(self, x: float) -> float:
        k, v = self.knots, self.values
        if len(k) == 1 or x <= k[0]:
            return v[0]
        i = bisect_right(k, x) - 1
        if i >= len(k) - 1:
            i = len(k) - 2  # extrapolate along the last segment
        t = (x - k[i]) / (k[i + 1] - k[i])
        return v[i] + t * (v[i + 1] - v[i])


def _hat_basis(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    basis = np.zeros((len(x), len(knots)))
    xc = np.clip(x, knots[0], None)
    idx = np.clip(np.searchsorted(knots, xc, side="right") - 1, 0, len(knots) - 2)
    t = (xc - knots[idx]) / (knots[idx + 1] - knots[idx])
    rows = np.arange(len(x))
    basis[rows, idx] = 1 - t
    basis[rows, idx + 1] = t
    return basis


def _choose_num_knots(x: np.ndarray, y: np.ndarray, folds: int = 5) -> int:
    """Knot count by k-fold cross-validation on the training rows only."""
    candidates = [k for k in (8, 16, 32, 64, 128) if k <= max(2, len(np.unique(x)))]
    if len(x) < 2 * folds or len(candidates) <= 1:
        return candidates[0] if candidates else 2
    order = np.random.default_rng(0).permutation(len(x))
    best, best_err = candidates[0], float("inf")
    for k in candidates:
        errs = []
        for f in range(folds):
            test = order[f::folds]
            train = np.setdiff1d(order, test)
            model = PiecewiseLinear.fit(x[train], y[train], k)
            errs += [abs(model(xi) - yi) / yi for xi, yi in zip(x[test], y[test])]
        err = float(np.median(errs))
        if err < best_err:
            best, best_err = k, err
    return best


class LinearModel:
    """y = max(floor, features . coef), fitted by relative least squares."""

    def __init__(self, coef: Sequence[float], floor: float) -> None:
        self.coef = [float(c) for c in coef]
        self.floor = float(floor)

    @classmethod
    @one_blas_thread
    def fit(cls, features: np.ndarray, y: Sequence[float]) -> LinearModel:
        y_arr = np.asarray(y, float)
        w = 1.0 / np.maximum(np.abs(y_arr), 1e-12)
        coef, *_ = np.linalg.lstsq(features * w[:, None], y_arr * w, rcond=None)
        return cls(coef, float(np.min(y_arr)) * 0.5)

    def __call__(self, *features: float) -> float:
        return max(self.floor, sum(c * f for c, f in zip(self.coef, features)))
