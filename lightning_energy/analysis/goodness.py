"""When a fit's R² says something: only when spare points (more points than the fit has parameters) test it.

A quadratic (3 parameters) through 3 points passes through all of them whatever they are, so its R² is 1 by
construction and says nothing about whether a quadratic describes the data. With more points than parameters
the points the fit did not need can disagree with it, and R² measures how much they do.
"""

from __future__ import annotations

import math

from lightning_energy.fitting import QUADRATIC_PARAMETERS


def spare_points(n_points: int, parameters: int = QUADRATIC_PARAMETERS) -> int:
    """How many points beyond the fit's parameters test it (0 or more)."""
    return max(n_points - parameters, 0)


def tested_r2(r2: float, n_points: int, parameters: int = QUADRATIC_PARAMETERS) -> float | None:
    """``r2`` where spare points test it, else None (an exact fit: R² = 1 by construction)."""
    return r2 if spare_points(n_points, parameters) > 0 and math.isfinite(r2) else None


def describe_r2(r2: float, n_points: int, parameters: int = QUADRATIC_PARAMETERS) -> str:
    """``"R² = 0.987 (5 points, 2 spare)"``, or ``"exact fit through 3 points, no spare point to test it"``."""
    shown = tested_r2(r2, n_points, parameters)
    if shown is None:
        if spare_points(n_points, parameters) == 0:
            return f"exact fit through {n_points} points, no spare point to test it"
        return f"R² undefined ({n_points} points with the same value)"
    spare = spare_points(n_points, parameters)
    return f"R² = {shown:.3f} ({n_points} points, {spare} spare)"
