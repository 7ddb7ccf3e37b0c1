"""The quadratic fit of the offline analysis (``lightning-energy fit``): :func:`quadratic_fit` and its result
:class:`QuadraticFit`, defined in :mod:`lightning_energy.fitting` (below both the analysis and the power-limit
optimiser, which fits its profile with it too)."""

from __future__ import annotations

from lightning_energy.fitting import QuadraticFit, quadratic_fit

__all__ = ["QuadraticFit", "quadratic_fit"]
