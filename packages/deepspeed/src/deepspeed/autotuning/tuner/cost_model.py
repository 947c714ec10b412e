"""The model-based tuner's cost model: ridge regression on standardized features and their squares.

DeepSpeed fits XGBoost here; with the handful of points a tuning session measures (tens at most), a quadratic
ridge fit ranks configurations as well. It is plain Python (a linear system of ``1 + 2 x features`` unknowns,
solved by Gaussian elimination): the Autotuner runs in the launcher process, which imports neither torch nor
numpy. ``fit`` normalizes the targets by their largest magnitude, so the regularization strength does not
depend on the metric's units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class RidgeCostModel:
    """Predicts a score (higher is better) from a configuration's feature vector."""

    def __init__(self, alpha: float = 1e-2) -> None:
        if not alpha >= 0:
            raise ValueError(f"RidgeCostModel: alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self._mean: list[float] = []
        self._std: list[float] = []
        self._weights: list[float] | None = None

    @property
    def fitted(self) -> bool:
        return self._weights is not None

    def _design(self, x: Sequence[float]) -> list[float]:
        z = [(v - m) / s for v, m, s in zip(x, self._mean, self._std, strict=True)]
        return [1.0, *z, *(v * v for v in z)]

    def fit(self, xs: Sequence[Sequence[float]], ys: Sequence[float]) -> None:
        """Least squares with an L2 penalty (not on the intercept) on ``(1, z, z**2)``, ``z`` the standardized
        features."""
        width = len(xs[0]) if len(xs) else -1
        if not len(ys) or len(xs) != len(ys) or any(len(x) != width for x in xs):
            raise ValueError(f"RidgeCostModel.fit: need one feature row of equal length per target, got "
                             f"{len(xs)} rows and {len(ys)} targets")
        n = len(xs)
        self._mean = [sum(col) / n for col in zip(*xs, strict=True)] if width else []
        self._std = [math.sqrt(sum((v - m) ** 2 for v in col) / n) or 1.0
                     for col, m in zip(zip(*xs, strict=True), self._mean, strict=True)] if width else []
        scale = max(max(abs(y) for y in ys), 1e-12)
        rows = [self._design(x) for x in xs]
        k = len(rows[0])
        # normal equations (A^T A + alpha I') w = A^T y, I' without the intercept
        lhs = [[sum(r[i] * r[j] for r in rows) + (self.alpha if i == j and i else 0.0) for j in range(k)]
               for i in range(k)]
        rhs = [sum(r[i] * y / scale for r, y in zip(rows, ys, strict=True)) for i in range(k)]
        self._weights = [w * scale for w in _solve(lhs, rhs)]

    def predict(self, xs: Sequence[Sequence[float]]) -> list[float]:
        if self._weights is None:
            raise RuntimeError("RidgeCostModel.predict called before fit")
        return [sum(w * d for w, d in zip(self._weights, self._design(x), strict=True)) for x in xs]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting; a (near-)singular direction gets weight 0
    (with ``alpha`` > 0 only the unpenalized intercept could be, and then only without data)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            continue
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(n)]
