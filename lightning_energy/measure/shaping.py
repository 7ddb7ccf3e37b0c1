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
other period (a whole multiple of the counter's, on a fixed phase).

Other cards, drivers and loads may have another window length and lag. So the placement is estimated from
the run (:class:`WindowPlacement`): every few counter periods, the placement (lag from the estimated refresh,
window length, on a grid over the sensor's range, by default :data:`SHAPE_LAG_RANGE_S` and
:data:`SHAPE_WINDOW_RANGE_S`) that best fits the periods' exact energies and the windows' powers gathers
evidence; the sensor's own figures stay in force while the readings allow them, and windows are placed
at the likeliest placement. On ``tests/
test_series_shaping_robust.py``'s fake (45 ms windows ending 18 ms before the refresh, declared 25/11 ms,
100 ms ±30 % steps of 150/50 W, steps after the first 4 s) the step error went from 3.0-7.6 % median
(26-70 % p95; three seeds) to 0.4-0.6 % (1.9-4.7 %). Limits: windows are placed only once the refresh
phase is pinned (0.3-1.3 s into the truth benchmark's fits) and the estimate needs a few batches of
:data:`SHAPE_ESTIMATE_PERIODS` periods with boundaries after that; steps before then are the plain or the
declared placement's. Steps locked to the period teach it nothing (skipped: :func:`_locked`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

from lightning_energy.measure.sensors.base import Sensor

SHAPE_WINDOWS_KEPT = 8  # placed windows ShapeReading.windows shows (the rule looks at three counter periods)
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

# Where a window may lie: the design range of its lag and length (s), for a sensor that declares none of its
# own (``shape_lag_range_s``, ``shape_window_range_s``). One H200 measured 11 ms and 25 ms; other cards,
# drivers and loads may differ, and the end-to-end truth benchmark draws lags of 5-20 ms and lengths of
# 20-50 ms. The range always holds the sensor's own figures (``shape_lag_s``, ``shape_window_s``).
SHAPE_LAG_RANGE_S = (0.005, 0.020)
SHAPE_WINDOW_RANGE_S = (0.020, 0.050)
# The lag is searched SHAPE_PLACEMENT_S wider on both sides: it is counted from the estimated refresh, whose
# own error (up to ±SHAPE_PLACEMENT_S once windows are placed) it then absorbs. Grid steps (s):
SHAPE_LAG_STEP_S = 0.001
SHAPE_WINDOW_STEP_S = 0.0025
# How well a window's power is known (W) beside its placement: the floor of a residual's scale (the fake's
# readings are exact to the mW; a real card's follow the model to R² 0.98, and then the fit's own residuals
# set the scale).
SHAPE_READING_NOISE_W = 1.0
# The placement is estimated from batches of SHAPE_ESTIMATE_PERIODS counter periods (the last two periods of
# one batch begin the next: windows near a batch's edges are left out), each batch's evidence added to the
# last ones', older evidence fading by SHAPE_EVIDENCE_DECAY per batch (a placement that moves is followed
# within a few batches: the refresh phase's estimate narrows as a run goes on). A placement is plausible
# while its evidence against it stays within SHAPE_PLAUSIBLE_CHI2 (χ² of two parameters at 95 %).
SHAPE_ESTIMATE_PERIODS = 6
SHAPE_ESTIMATE_OVERLAP = 2
SHAPE_EVIDENCE_DECAY = 0.9
SHAPE_PLAUSIBLE_CHI2 = 5.99
SHAPE_LOCKED_S = 0.005  # a batch whose boundaries all lie within 5 ms of one phase of the period: skipped
SHAPE_WINDOWS_HELD = 4 * SHAPE_ESTIMATE_PERIODS  # windows held for the estimate and the rule (one per period)


def shape_window_s(sensor: Sensor) -> float | None:
    """Length (s) of the window over which a counter sensor's power reading averages.

    A sensor opts in with the attribute ``shape_window_s`` (and ``shape_power_field``, the key of
    :meth:`Sensor.read_fields` holding that power in W, which the sampler passes with each reading; and
    ``shape_lag_s``, see :func:`shape_lag_s`): NVML's instant power on A100/H100/H200 is the mean over the
    ~25 ms the power sensor observes in each 100 ms (one H200). The field refreshes every
    ``counter_update_period_s`` on its own schedule. None for other sensors. The series treats this and the
    lag as the likeliest placement until the run's own readings say better (:class:`WindowPlacement`).
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


def shape_ranges_s(sensor: Sensor) -> tuple[tuple[float, float], tuple[float, float]]:
    """The lags and window lengths (s) a sensor's windows may have: ``(low, high)`` each, the sensor's own
    ``shape_lag_range_s`` / ``shape_window_range_s`` or the design range (:data:`SHAPE_LAG_RANGE_S`,
    :data:`SHAPE_WINDOW_RANGE_S`), widened to hold its own ``shape_lag_s`` and ``shape_window_s``."""
    lag, window = shape_lag_s(sensor), shape_window_s(sensor) or 0.0
    out = []
    for name, default, own in (("shape_lag_range_s", SHAPE_LAG_RANGE_S, lag),
                               ("shape_window_range_s", SHAPE_WINDOW_RANGE_S, window)):
        low, high = getattr(sensor, name, None) or default
        out.append((min(float(low), own), max(float(high), own)))
    return out[0], out[1]


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _fractions(edges, starts, ends):
    """Share (0..1) of each window ``[starts, ends]`` (arrays of any shape) in each segment between ``edges``:
    shape ``starts.shape + (segments,)``. A window of no length counts whole in the segment it falls in."""
    import numpy as np

    edges = np.asarray(edges, dtype=float)
    starts = np.asarray(starts, dtype=float)
    ends = np.maximum(np.asarray(ends, dtype=float), starts + 1e-9)
    inside = np.minimum(ends[..., None], edges[1:]) - np.maximum(starts[..., None], edges[:-1])
    return np.clip(inside, 0.0, None) / (ends - starts)[..., None]


def _period_rows(edges, periods):
    """Rows and right-hand sides of the counter periods ``(start, end, J)`` (their mean power) and of the
    pull of every segment towards the mean of the period holding its middle."""
    import numpy as np

    n = len(edges) - 1
    rows = [[_overlap(edges[k], edges[k + 1], a, b) / (b - a) for k in range(n)] for a, b, _ in periods]
    means = [energy / (b - a) for a, b, energy in periods]
    pulls = []
    for k in range(n):
        mid = (edges[k] + edges[k + 1]) / 2.0
        pulls.append(next((e / (b - a) for a, b, e in periods if a <= mid <= b), means[0]))
    rows = np.vstack([np.asarray(rows, dtype=float).reshape(len(periods), n), SHAPE_PRIOR_WEIGHT * np.eye(n)])
    return rows, np.asarray(means + [SHAPE_PRIOR_WEIGHT * p for p in pulls], dtype=float)


def segment_powers(bounds: list[float], periods: list[tuple[float, float, float]],
                   windows: list[tuple[float, float, float]]) -> list[float]:
    """Power (W) of each segment between consecutive ``bounds`` (the boundaries), constant in each, that best
    fits the counter periods ``(start, end, exact J)`` and the power windows ``(start, end, mean W)``.

    Least squares over: each period's mean power (exact), each window's mean power (its share of each
    segment; a window of no length is the power of the segment it falls in), and a weak pull of every segment
    towards the mean of the period holding its middle (:data:`SHAPE_PRIOR_WEIGHT`), which settles segments
    that no reading separates. Clipped at 0 W.
    """
    import numpy as np

    rows, rhs = _period_rows(bounds, periods)
    if windows:
        starts, ends, watts = zip(*windows)
        rows = np.vstack([rows, _fractions(bounds, starts, ends)])
        rhs = np.concatenate([rhs, np.asarray(watts, dtype=float)])
    return [max(float(p), 0.0) for p in np.linalg.lstsq(rows, rhs, rcond=None)[0]]


def _locked(times: list[float], period_s: float) -> bool:
    """Whether ``times`` (s) all fall within :data:`SHAPE_LOCKED_S` of one phase of the period (steps locked
    to the readings' schedule)."""
    phases = sorted(t % period_s for t in times)
    gaps = [b - a for a, b in zip(phases, phases[1:])] + [phases[0] + period_s - phases[-1]]
    return period_s - max(gaps) <= SHAPE_LOCKED_S


class WindowPlacement:
    """Where a power reading's windows lie: the lag (s, from the estimated refresh to the window's end) and
    the length (s) of the window, on a grid over the sensor's range (:func:`shape_ranges_s`, the lag widened
    by :data:`SHAPE_PLACEMENT_S`), and which of them the run's readings still allow.

    Each batch of counter periods (:meth:`add_evidence`) is fitted by every placement in turn (segment powers
    between the step boundaries by least squares to the periods' exact energies and the windows' powers);
    a placement's evidence against it is how much worse its fit is than the best one's, in units of the
    batch's residual scale (the best fit's residual per window, at least :data:`SHAPE_READING_NOISE_W`).
    Placements whose accumulated evidence stays within :data:`SHAPE_PLAUSIBLE_CHI2` of the best are
    :attr:`plausible`. Windows that straddle a boundary carry the information (a window inside one segment
    reads the same under every placement); flat stretches leave the estimate where it was. A batch whose
    boundaries all sit within :data:`SHAPE_LOCKED_S` of one phase of the period (steps locked to the
    readings' schedule) is skipped: its windows all straddle at one fraction, which fixes only
    ``lag + fraction × length`` (a line of placements), and the counter's own placement jitter (±0.5 ms in
    ``tests/test_series.py``) then moved the estimate along that line, away from the truth.
    """

    def __init__(self, lag_s: float, window_s: float, lag_range_s: tuple[float, float],
                 window_range_s: tuple[float, float]) -> None:
        import numpy as np

        def grid(low: float, high: float, step: float):
            count = max(int(round((high - low) / step)), 0) + 1
            return np.linspace(low, high, count)

        lags = grid(lag_range_s[0] - SHAPE_PLACEMENT_S, lag_range_s[1] + SHAPE_PLACEMENT_S, SHAPE_LAG_STEP_S)
        lengths = grid(window_range_s[0], window_range_s[1], SHAPE_WINDOW_STEP_S)
        self.lags_s, self.lengths_s = (a.ravel() for a in np.meshgrid(lags, lengths))
        self.assumed = (float(lag_s), float(window_s))
        # ties go to the placement nearest to the sensor's own figures
        self._tie = 1e-6 * np.hypot(self.lags_s - lag_s, self.lengths_s - window_s) / SHAPE_LAG_STEP_S
        self.evidence = np.zeros(len(self.lags_s))
        self.batches = 0  # batches that told placements apart

    @property
    def plausible(self):
        """Mask of the placements the readings allow: only the sensor's own figures (the grid's nearest) until
        a batch tells placements apart, then those within :data:`SHAPE_PLAUSIBLE_CHI2` of the best."""
        if not self.batches:
            return self._tie == self._tie.min()
        return self.evidence - self.evidence.min() <= SHAPE_PLAUSIBLE_CHI2

    @property
    def best(self) -> tuple[float, float]:
        """The placement ``(lag s, length s)`` windows are placed at: the sensor's own figures while the
        readings allow them, else the one with the least evidence against it."""
        if not self.batches:
            return self.assumed
        if self.plausible[int(self._tie.argmin())]:
            return self.assumed
        i = int((self.evidence + self._tie).argmin())
        return float(self.lags_s[i]), float(self.lengths_s[i])

    def spans(self):
        """``(lags s, lengths s)`` of the plausible placements (arrays)."""
        mask = self.plausible
        return self.lags_s[mask], self.lengths_s[mask]

    def describe(self) -> str:
        if not self.batches:
            return "not yet estimated from the run"
        lags, lengths = self.spans()
        def span(values) -> str:
            low, high = values.min() * 1000, values.max() * 1000
            return f"{low:.0f} ms" if high - low < 0.5 else f"{low:.0f}-{high:.0f} ms"
        return f"estimated from the run: window {span(lengths)}, lag {span(lags)}"

    def add_evidence(self, edges: list[float], periods: list[tuple[float, float, float]],
                     anchors: list[float], watts: list[float]) -> None:
        """One batch: segments between ``edges`` (the batch's start, its step boundaries, its end), the
        counter ``periods`` ``(start, end, J)`` that tile it, and the windows that lie in it under every
        placement (``anchors``: the estimated refreshes, s; ``watts``: their powers)."""
        import numpy as np

        if len(anchors) < 2 or len(edges) < 3:
            return
        fixed_rows, fixed_rhs = _period_rows(edges, periods)
        anchors_a, watts_a = np.asarray(anchors, dtype=float), np.asarray(watts, dtype=float)
        ends = anchors_a[None, :] - self.lags_s[:, None]  # (placements, windows)
        rows = _fractions(edges, ends - self.lengths_s[:, None], ends)  # (placements, windows, segments)
        normal = fixed_rows.T @ fixed_rows + np.einsum("cws,cwt->cst", rows, rows)
        rhs = fixed_rows.T @ fixed_rhs + np.einsum("cws,w->cs", rows, watts_a)
        powers = np.linalg.solve(normal, rhs[..., None])[..., 0]  # (placements, segments)
        misfit = (np.einsum("cws,cs->cw", rows, powers) - watts_a) ** 2
        residual = misfit.sum(axis=1) + ((powers @ fixed_rows.T - fixed_rhs) ** 2).sum(axis=1)
        if float(residual.max() - residual.min()) <= 1e-12:
            return  # every placement fits alike: nothing learnt
        scale = max(SHAPE_READING_NOISE_W ** 2, float(residual.min()) / max(len(anchors) - 2, 1))
        self.evidence = SHAPE_EVIDENCE_DECAY * self.evidence + (residual - residual.min()) / scale
        self.batches += 1


class ShapeReading:
    """The power reading of one counter sensor: its refresh schedule, the windows it averaged, where they
    lie (:class:`WindowPlacement`), and whether the card follows the model (see the module docstring).

    ``phase_factory(period_s)`` builds the phase estimator of the refreshes (the series' ``CounterPhase``).
    ``fallback``: why the reading is no longer used (None while it is).
    """

    def __init__(self, sensor: Sensor, period_s: float, phase_factory: Callable[[float], object]) -> None:
        self.field = getattr(sensor, "shape_power_field", None) or "the power reading"
        self.window_s = shape_window_s(sensor) or 0.0
        self.lag_s = shape_lag_s(sensor)
        self.period_s = float(period_s)
        self.phase = phase_factory(self.period_s)
        self.placement = WindowPlacement(self.lag_s, self.window_s, *shape_ranges_s(sensor))
        self.refreshes: deque[tuple[float, float]] = deque(maxlen=SHAPE_WINDOWS_HELD)  # (estimated refresh s, W)
        self.fallback: str | None = None
        self._last_w: float | None = None
        self._unplaced_changes = 0  # changes seen since windows could last be placed
        self._on_schedule: deque[bool] = deque(maxlen=SHAPE_CHECKED_REFRESHES)  # recent changes, pinned
        # the counter periods since the last batch of the placement's estimate: (start, end, J, boundaries)
        self._batch: list[tuple[float, float, float, list[float]]] = []

    @property
    def windows(self) -> list[tuple[float, float, float]]:
        """``(start s, end s, W)`` of the latest :data:`SHAPE_WINDOWS_KEPT` windows, placed at the likeliest
        placement (:attr:`WindowPlacement.best`), the latest last."""
        lag, length = self.placement.best
        latest = list(self.refreshes)[-SHAPE_WINDOWS_KEPT:]
        return [(r - lag - length, r - lag, w) for r, w in latest]

    def windows_within(self, lo: float, hi: float) -> list[tuple[float, float, float]]:
        """The windows ``(start s, end s, W)`` at the likeliest placement (:attr:`WindowPlacement.best`) that
        lie in ``[lo, hi]``, for :func:`segment_powers`. (Weighing each window over every plausible placement,
        which :func:`segment_powers` can do, cost accuracy on ``benchmarks/shaping_phases.py``: 70-130 ms
        steps with one mark, median of medians 0.40 -> 0.49 % with instant counter reads: not kept.)"""
        lag, length = self.placement.best
        return [(r - lag - length, r - lag, w) for r, w in self.refreshes
                if r - lag - length >= lo - 1e-9 and r - lag <= hi + 1e-9]

    def add_period(self, start_s: float, end_s: float, energy_J: float, boundaries: list[float]) -> None:
        """A counter period whose step boundaries are final: ``(start_s, end_s)``, its exact ``energy_J`` and
        the times (s) of the boundaries inside it. Every :data:`SHAPE_ESTIMATE_PERIODS` of them make a batch
        of evidence for the windows' placement."""
        if not self.placing or not end_s > start_s:
            return
        batch = self._batch
        if batch and abs(batch[-1][1] - start_s) > 1e-9:
            batch.clear()  # not contiguous (a point skipped): start afresh
        batch.append((start_s, end_s, energy_J, list(boundaries)))
        if len(batch) < SHAPE_ESTIMATE_PERIODS:
            return
        lo, hi = batch[0][0], batch[-1][1]
        bounds = sorted(b for *_, inside in batch for b in inside)
        if bounds and not _locked(bounds, self.period_s):
            lags, lengths = self.placement.lags_s, self.placement.lengths_s
            earliest, latest = float((lags + lengths).max()), float(lags.min())
            chosen = [(r, w) for r, w in self.refreshes if r - earliest >= lo and r - latest <= hi]
            self.placement.add_evidence([lo, *bounds, hi], [(a, b, e) for a, b, e, _ in batch],
                                        [r for r, _ in chosen], [w for _, w in chosen])
        del batch[:-SHAPE_ESTIMATE_OVERLAP]

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
        shaped = (f"{self.field} (window {self.window_s * 1000:g} ms, lag {self.lag_s * 1000:g} ms assumed; "
                  f"placement {self.placement.describe()})")
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
                self.refreshes.append((min(max(refresh, lo), hi), max(power_w, 0.0)))
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
        self.refreshes.clear()
        self._batch.clear()
