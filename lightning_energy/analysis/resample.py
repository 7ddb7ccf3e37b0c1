"""Runs on a common time axis: resampling to an even grid, padding to the longest, masked mean ± std.

The GPU power study's method: each run's curve is interpolated with a cubic spline onto an even grid
(4 Hz by default) starting at the run's own start, the curves are padded to the longest run, the
padding is masked (``numpy.ma``), and mean and standard deviation are taken over the runs still
going at each grid point.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_RATE_HZ = 4.0


def even_grid(duration_s: float, rate_hz: float = DEFAULT_RATE_HZ) -> np.ndarray:
    """Times 0, 1/rate, 2/rate, ... up to ``duration_s`` inclusive (s)."""
    if not rate_hz > 0 or not math.isfinite(rate_hz):
        raise ValueError(f"resampling rate must be a positive number of Hz, got {rate_hz!r}")
    if not duration_s >= 0:
        raise ValueError(f"duration must be >= 0 s, got {duration_s!r}")
    count = int(math.floor(duration_s * rate_hz + 1e-9)) + 1
    return np.arange(count) / rate_hz


def resample(time_s, values, rate_hz: float = DEFAULT_RATE_HZ, start_s: float | None = None,
             end_s: float | None = None, kind: str = "cubic") -> tuple[np.ndarray, np.ndarray]:
    """``values`` sampled at ``time_s`` interpolated onto an even grid from ``start_s`` to ``end_s``.

    Returns (grid relative to ``start_s`` in s, values on it). ``kind`` is ``"cubic"`` (a not-a-knot
    cubic spline, falling back to linear with fewer than 4 points) or ``"linear"``. NaN samples and
    repeated times are dropped first.
    """
    t = np.asarray(time_s, dtype=float)
    y = np.asarray(values, dtype=float)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"time and values must be 1-d of the same length, got {t.shape} and {y.shape}")
    keep = np.isfinite(t) & np.isfinite(y)
    t, y = t[keep], y[keep]
    t, unique = np.unique(t, return_index=True)
    y = y[unique]
    if len(t) < 2:
        raise ValueError("resampling needs at least 2 samples")
    start = float(t[0]) if start_s is None else float(start_s)
    end = float(t[-1]) if end_s is None else float(end_s)
    if start < t[0] - 1e-9 or end > t[-1] + 1e-9 or end < start:
        raise ValueError(f"resampling window [{start}, {end}] s is outside the samples [{t[0]}, {t[-1]}] s")
    grid = even_grid(end - start, rate_hz)
    at = np.clip(start + grid, t[0], t[-1])
    if kind == "cubic" and len(t) >= 4:
        from scipy.interpolate import CubicSpline

        return grid, CubicSpline(t, y, bc_type="not-a-knot")(at)
    if kind not in ("cubic", "linear"):
        raise ValueError(f"interpolation kind must be 'cubic' or 'linear', got {kind!r}")
    return grid, np.interp(at, t, y)


def pad_and_mask(curves: list) -> np.ma.MaskedArray:
    """Curves of different lengths as one (runs x longest) masked array, the padding masked."""
    if not curves:
        raise ValueError("no curves to pad")
    longest = max(len(c) for c in curves)
    data = np.zeros((len(curves), longest))
    mask = np.ones((len(curves), longest), dtype=bool)
    for i, curve in enumerate(curves):
        data[i, : len(curve)] = curve
        mask[i, : len(curve)] = False
    return np.ma.MaskedArray(data, mask=mask)


def mean_std(stacked: np.ma.MaskedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per grid point: mean, population standard deviation (ddof 0) and number of runs, over unmasked runs."""
    mean = stacked.mean(axis=0)
    std = stacked.std(axis=0)
    count = stacked.count(axis=0)
    return np.ma.filled(mean, np.nan), np.ma.filled(std, np.nan), np.asarray(count)
