"""The NVML shaping model: a counter's period shared out by the power reading read along with it.

NVML on A100/H100/H200 has, besides the energy counter (exact every ~100 ms), an instant power field
(``shape_power_field``) which, as measured on one H200 with one driver (``benchmarks/nvml_semantics.py``),
refreshes every 100.0 ms on a clock of its own (38 to 82 ms after the counter's updates, medians of four
runs: not with them) and holds the mean power over ``shape_window_s`` (25 ms) ending ``shape_lag_s``
(11 ms) before its refresh. :class:`ShapeReading` pins the field's refresh phase down from the reads that
see it change (a ``CounterPhase``, as for the counter) and places each window on it; until then it places
none. The series (:mod:`lightning_energy.measure.series`) then shares out every counter period that holds a
step boundary by :func:`segment_powers`: one power per segment between boundaries over the periods before,
of and after it, fitted to those periods' exact energies and to their windows' powers; the period's own
exact energy is then shared out in proportion to the fitted segments (energy-conserving: every counter update
keeps its value, so epochs stay counter-exact).

The window and the lag come from that one card. Other cards may refresh the field on another schedule, so
the schedule is checked at run time (:class:`ShapeReading`): the field must refresh once per counter period
on a fixed phase. A field whose refresh phase is not known to within :data:`SHAPE_PLACEMENT_S` after
:data:`SHAPE_PIN_REFRESHES` changes (refreshes at random, a period that disagrees with the counter's, a phase
that keeps moving), or whose changes fall off the pinned schedule in :data:`SHAPE_ODD_REFRESHES` of the last
:data:`SHAPE_CHECKED_REFRESHES`, stops being used for that series for good: the series falls back to the
plain counter rule and says so (:attr:`ShapeReading.status`). Not detected: a field that refreshes every
other period (a whole multiple of the counter's, on a fixed phase), or a window or lag other than assumed.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Callable

from lightning_energy.measure.sensors.base import Sensor

SHAPE_WINDOWS_KEPT = 8  # power-reading windows kept (the rule looks at three counter periods)
SHAPE_PRIOR_WEIGHT = 0.05  # pull of each segment's power towards its counter period's mean (W per W)
SHAPE_PLACEMENT_S = 0.010  # windows are placed once the reading's refresh phase is known within ±10 ms
# Run-time check of the reading's schedule. With reads every 50 ms + 0-2 ms the fake H200's refresh phase
# is known within ±10 ms after 3-30 changes of the field (0.3-3 s at load: the reads drift across the
# refresh); 300 changes leave a wide margin for a sampler whose reads drift slowly, and still end shaping
# early in a fit where the card does not follow. Changes, not time: an idle card may hold its value.
SHAPE_PIN_REFRESHES = 300
# Of the last SHAPE_CHECKED_REFRESHES changes of the field seen once its phase is pinned, this many off the
# schedule (no expected refresh within the read interval that saw it) end shaping: an H200 has none but a
# late read now and then; a field refreshing every 150 ms or at random has half or more.
SHAPE_CHECKED_REFRESHES = 16
SHAPE_ODD_REFRESHES = 4


def shape_window_s(sensor: Sensor) -> float | None:
    """Length (s) of the window over which a counter sensor's power reading averages.

    A sensor opts in with the attribute ``shape_window_s`` (and ``shape_power_field``, the key of
    :meth:`Sensor.read_fields` holding that power in W, which the sampler passes with each reading; and
    ``shape_lag_s``, see :func:`shape_lag_s`): NVML's instant power on A100/H100/H200 is the mean over the
    ~25 ms the power sensor observes in each 100 ms. The field refreshes every ``counter_update_period_s``
    on its own schedule. None for other sensors.
    """
    window = getattr(sensor, "shape_window_s", None)
    if window is None or getattr(sensor, "counter_update_period_s", None) is None:
        return None
    window = float(window)
    return window if window >= 0.0 else None


def shape_lag_s(sensor: Sensor) -> float:
    """How long (s) before each refresh of the power reading its window ends (``shape_lag_s``, default 0)."""
    lag = float(getattr(sensor, "shape_lag_s", 0.0) or 0.0)
    return lag if lag >= 0.0 else 0.0


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def segment_powers(bounds: list[float], periods: list[tuple[float, float, float]],
                   windows: list[tuple[float, float, float]]) -> list[float]:
    """Power (W) of each segment between consecutive ``bounds`` (the boundaries), constant in each, that best
    fits the counter periods ``(start, end, exact J)`` and the power windows ``(start, end, mean W)``.

    Least squares over: each period's mean power (exact), each window's mean power, and a weak pull of
    every segment towards the mean of the period holding its middle (:data:`SHAPE_PRIOR_WEIGHT`), which
    settles segments that no reading separates. Clipped at 0 W.
    """
    import numpy as np

    n = len(bounds) - 1
    rows, rhs = [], []
    for a, b, energy in periods:
        rows.append([_overlap(bounds[k], bounds[k + 1], a, b) / (b - a) for k in range(n)])
        rhs.append(energy / (b - a))
    for a, b, watts in windows:
        if b > a:
            rows.append([_overlap(bounds[k], bounds[k + 1], a, b) / (b - a) for k in range(n)])
        else:  # an instantaneous reading: the power of the segment it falls in
            k = min(max(bisect.bisect_right(bounds, a) - 1, 0), n - 1)
            rows.append([1.0 if j == k else 0.0 for j in range(n)])
        rhs.append(watts)
    for k in range(n):
        mid = (bounds[k] + bounds[k + 1]) / 2.0
        mean = next((e / (b - a) for a, b, e in periods if a <= mid <= b), rhs[0])
        rows.append([SHAPE_PRIOR_WEIGHT if j == k else 0.0 for j in range(n)])
        rhs.append(SHAPE_PRIOR_WEIGHT * mean)
    solution = np.linalg.lstsq(np.asarray(rows), np.asarray(rhs), rcond=None)[0]
    return [max(float(p), 0.0) for p in solution]


class ShapeReading:
    """The power reading of one counter sensor: its refresh schedule, the windows it averaged, and whether
    the card follows the model (see the module docstring).

    ``phase_factory(period_s)`` builds the phase estimator of the refreshes (the series' ``CounterPhase``).
    ``windows``: ``(start s, end s, W)`` of the windows the readings averaged, one per refresh, the latest
    last. ``fallback``: why the reading is no longer used (None while it is).
    """

    def __init__(self, sensor: Sensor, period_s: float, phase_factory: Callable[[float], object]) -> None:
        self.field = getattr(sensor, "shape_power_field", None) or "the power reading"
        self.window_s = shape_window_s(sensor) or 0.0
        self.lag_s = shape_lag_s(sensor)
        self.period_s = float(period_s)
        self.phase = phase_factory(self.period_s)
        self.windows: deque[tuple[float, float, float]] = deque(maxlen=SHAPE_WINDOWS_KEPT)
        self.fallback: str | None = None
        self._last_w: float | None = None
        self._unplaced_changes = 0  # changes seen since windows could last be placed
        self._on_schedule: deque[bool] = deque(maxlen=SHAPE_CHECKED_REFRESHES)  # recent changes, pinned

    @property
    def active(self) -> bool:
        """True while the reading is used (it may not place windows yet)."""
        return self.fallback is None

    @property
    def placing(self) -> bool:
        """True when the refresh phase is known well enough to place windows."""
        phase = self.phase
        return self.fallback is None and phase.pinned and phase.window_s() <= SHAPE_PLACEMENT_S

    @property
    def status(self) -> str:
        """A short human-readable account of the rule in force for this series."""
        if self.fallback is not None:
            return f"plain counter rule: {self.fallback}"
        shaped = f"{self.field} (window {self.window_s * 1000:g} ms, lag {self.lag_s * 1000:g} ms)"
        if self.placing:
            return f"shaped by {shaped}"
        return f"plain counter rule until the refresh schedule of {self.field} is pinned, then shaped by {shaped}"

    def add(self, lo: float, hi: float, power_w: float) -> None:
        """A power reading read by ``hi`` (previous read at ``lo``): a changed value is a refresh in
        ``(lo, hi]``; it pins the refresh phase down and, once pinned, adds its window. Once pinned, an
        unchanged value across a refresh surely inside ``(lo, hi]`` is that refresh keeping the value (the
        field refreshes every period: measured on an H200), and adds its window too."""
        last, self._last_w = self._last_w, power_w
        if self.fallback is not None or last is None or not math.isfinite(lo) or not lo < hi:
            return
        phase, period, changed = self.phase, self.period_s, power_w != last
        if changed:
            phase.add_update(lo, hi)
        if not self.placing:  # the refresh could lie anywhere in (lo, hi], or too wide a span: no window yet
            self._unplaced_changes += changed
            if self._unplaced_changes > SHAPE_PIN_REFRESHES:
                moved = " again after its phase moved" if self._on_schedule else ""
                self._stop(f"the refresh schedule of {self.field} was not pinned{moved} within "
                           f"{SHAPE_PIN_REFRESHES} changes")
            return
        self._unplaced_changes = 0
        w, expected = phase.window_s(), phase.expected_update(hi)
        for refresh in (expected, expected - period, expected + period):
            # the scheduled refresh this read saw; unchanged, only one that surely fell inside (lo, hi]
            if (lo - w < refresh <= hi + w) if changed else (lo + w < refresh <= hi - w):
                end = min(max(refresh, lo), hi) - self.lag_s
                self.windows.append((end - self.window_s, end, max(power_w, 0.0)))
                if changed:
                    self._on_schedule.append(True)
                return
        if changed:  # a change where no refresh was due
            self._on_schedule.append(False)
            odd = self._on_schedule.count(False)
            if odd >= SHAPE_ODD_REFRESHES:
                self._stop(f"{self.field} changed off its {period * 1000:g} ms refresh schedule "
                           f"({odd} of the last {len(self._on_schedule)} changes)")

    def _stop(self, reason: str) -> None:
        self.fallback = reason
        self.windows.clear()
