"""Runs on a common time axis: resampling to an even grid, padding to the longest, masked mean ± std.

The GPU power study's method, with one change: each run's curves go onto an even grid (4 Hz by default)
starting at the run's own start, the curves are padded to the longest run, the padding is masked
(``numpy.ma``), and mean and standard deviation are taken over the runs still going at each grid point;
a cumulative curve (energy) is instead held at the run's total after its end (:func:`pad_and_hold`), so
the mean energy ends at the mean of the totals.
The study interpolated power with a cubic spline; through samples 1-3 ms apart that spline swings far
outside what the sensor can read (-444 W to +1,646 W for a sensor reading 8.5-85 W). Here the
cumulative energy (monotone) is interpolated linearly, and the power at a grid point is the mean power
over the grid interval centred on it, derived from that energy (:func:`resample_power`): it lies within
the power the samples hold, and the plotted power integrates to the plotted energy.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_energy.analysis import DEFAULT_RATE_HZ

# The most points one run's grid may have: about 69 h at the default 4 Hz. Each curve on it is 8 MB of
# float64 and a few times that as JSON in compare.json; a rate asking for more is refused before allocating.
MAX_GRID_POINTS = 1_000_000


def grid_points(duration_s: float, rate_hz: float = DEFAULT_RATE_HZ) -> int:
    """How many points :func:`even_grid` puts on ``duration_s`` (s) at ``rate_hz`` (Hz); ValueError for a rate
    that is not a positive finite number, a negative duration, or more than ``MAX_GRID_POINTS`` points
    (the message names the highest rate that fits)."""
    if not rate_hz > 0 or not math.isfinite(rate_hz):
        raise ValueError(f"resampling rate must be a positive number of Hz, got {rate_hz!r}")
    if not duration_s >= 0 or not math.isfinite(duration_s):
        raise ValueError(f"duration must be a finite number of s >= 0, got {duration_s!r}")
    intervals = duration_s * rate_hz  # a float: may be far beyond any int worth converting, or inf
    if intervals + 1 > MAX_GRID_POINTS:
        highest_hz = (MAX_GRID_POINTS - 1) / duration_s
        raise ValueError(f"resampling {duration_s:.4g} s at {rate_hz:g} Hz needs {intervals + 1:.3g} grid points, "
                         f"more than the {MAX_GRID_POINTS:,} allowed: use a rate of at most {highest_hz:.4g} Hz")
    return math.floor(intervals + 1e-9) + 1


def even_grid(duration_s: float, rate_hz: float = DEFAULT_RATE_HZ) -> np.ndarray:
    """Times 0, 1/rate, 2/rate, ... up to ``duration_s`` inclusive (s); at most ``MAX_GRID_POINTS`` of them
    (:func:`grid_points` refuses more before anything is allocated)."""
    return np.arange(grid_points(duration_s, rate_hz)) / rate_hz


def _clean(time_s, values) -> tuple[np.ndarray, np.ndarray]:
    """1-d float arrays with NaN samples and repeated times dropped; ValueError with fewer than 2 samples."""
    t = np.asarray(time_s, dtype=float)
    y = np.asarray(values, dtype=float)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"time and values must be 1-d of the same length, got {t.shape} and {y.shape}")
    keep = np.isfinite(t) & np.isfinite(y)
    t, y = t[keep], y[keep]
    t, unique = np.unique(t, return_index=True)
    if len(t) < 2:
        raise ValueError("resampling needs at least 2 samples")
    return t, y[unique]


def _window(t: np.ndarray, start_s: float | None, end_s: float | None) -> tuple[float, float]:
    start = float(t[0]) if start_s is None else float(start_s)
    end = float(t[-1]) if end_s is None else float(end_s)
    if start < t[0] - 1e-9 or end > t[-1] + 1e-9 or end < start:
        raise ValueError(f"resampling window [{start}, {end}] s is outside the samples [{t[0]}, {t[-1]}] s")
    return start, end


def resample(time_s, values, rate_hz: float = DEFAULT_RATE_HZ, start_s: float | None = None,
             end_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``values`` sampled at ``time_s`` interpolated linearly onto an even grid from ``start_s`` to ``end_s``.

    Returns (grid relative to ``start_s`` in s, values on it); every value lies between two samples, so
    a monotone series (cumulative energy) stays monotone. NaN samples and repeated times are dropped first.
    """
    t, y = _clean(time_s, values)
    start, end = _window(t, start_s, end_s)
    grid = even_grid(end - start, rate_hz)
    return grid, np.interp(np.clip(start + grid, t[0], t[-1]), t, y)


def resample_power(time_s, energy_J, rate_hz: float = DEFAULT_RATE_HZ, start_s: float | None = None,
                   end_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mean power (W) around each grid point, from cumulative energy (J) sampled at ``time_s`` (s).

    The value at grid point ``g`` is the energy over ``[g - h/2, g + h/2]`` (``h = 1 / rate_hz``, cut to
    the window ``[start_s, end_s]``) divided by that interval's length, the energy read off the linear
    interpolation of the cumulative samples. So it is a time-weighted mean of the mean powers between
    consecutive samples (within their range: no overshoot), and the intervals' energies add up to the
    energy between their outer edges. Returns (grid relative to ``start_s`` in s, W on it).
    """
    t, e = _clean(time_s, energy_J)
    start, end = _window(t, start_s, end_s)
    grid = even_grid(end - start, rate_hz)
    half = 0.5 / rate_hz
    lo = np.clip(start + grid - half, start, end)
    hi = np.clip(start + grid + half, start, end)
    if end == start:  # a window of no length: the mean power of the sample interval holding it
        i = min(int(np.searchsorted(t, start, side="right")), len(t) - 1)
        lo, hi = t[i - 1:i], t[i:i + 1]
    lo, hi = np.clip(lo, t[0], t[-1]), np.clip(hi, t[0], t[-1])
    return grid, (np.interp(hi, t, e) - np.interp(lo, t, e)) / (hi - lo)


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


def pad_and_hold(curves: list) -> np.ndarray:
    """Curves of different lengths as one (runs x longest) array, each curve held at its last value after its end.

    For cumulative quantities (energy, J): a run that finished has spent its total and spends no more, so the
    mean over runs ends at the mean of their totals (masking it instead would let the mean end at the longest
    run's total).
    """
    if not curves:
        raise ValueError("no curves to pad")
    longest = max(len(c) for c in curves)
    if any(len(c) == 0 for c in curves):
        raise ValueError("an empty curve has no last value to hold")
    return np.array([np.concatenate((c, np.full(longest - len(c), c[-1]))) for c in map(np.asarray, curves)],
                    dtype=float)


def mean_std(stacked: np.ma.MaskedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per grid point: mean, population standard deviation (ddof 0) and number of runs, over unmasked runs."""
    mean = stacked.mean(axis=0)
    std = stacked.std(axis=0)
    count = stacked.count(axis=0)
    return np.ma.filled(mean, np.nan), np.ma.filled(std, np.nan), np.asarray(count)
