"""Quadratic least-squares fit y = a x^2 + b x + c with its coefficient of determination R^2.

Plain numpy, below every layer that fits a curve: the power-limit optimiser's profile summary
(``optimize/power_limit/profile_file.py``) and the offline analysis (``analysis/fit.py``,
``lightning-energy fit``) both read it from here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

QUADRATIC_PARAMETERS = 3  # a, b and c of y = a x^2 + b x + c


@dataclass(frozen=True)
class QuadraticFit:
    """Coefficients of y = a x^2 + b x + c and R^2 = 1 - SS_res / SS_tot."""

    a: float
    b: float
    c: float
    r2: float
    n: int

    def __call__(self, x):
        x = np.asarray(x, dtype=float)
        return self.a * x**2 + self.b * x + self.c

    @property
    def vertex_x(self) -> float:
        """Where the parabola has its minimum (or maximum); NaN for a straight line."""
        return -self.b / (2 * self.a) if self.a != 0 else math.nan

    def as_dict(self) -> dict:
        return {**asdict(self), "vertex_x": self.vertex_x}


def quadratic_fit(x, y) -> QuadraticFit:
    """Least-squares quadratic through the points; needs 3 distinct x values and finite numbers."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-d of the same length, got {x.shape} and {y.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x and y must be finite numbers")
    if len(np.unique(x)) < 3:
        raise ValueError(f"a quadratic fit needs at least 3 distinct x values, got {len(np.unique(x))}")
    a, b, c = np.polyfit(x, y, 2)
    residual = y - (a * x**2 + b * x + c)
    ss_res = float(np.sum(residual**2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res <= 1e-24 else math.nan)
    return QuadraticFit(float(a), float(b), float(c), r2, len(x))
