"""Cumulative-energy series of one sensor: the points the sampler keeps and interpolation over them.

Every sensor becomes a list of (time s, cumulative energy J) points; a window's energy is the difference
of the linear interpolation of these points at its two edges.

- Power sensors add a point per sample, integrated with the trapezoid rule (exact for constant power and
  for linear ramps between samples).
- Counters without a known update period add a point per reading, at the time of the reading.
- Counters that only advance every ``counter_update_period_s`` (NVML's energy counter: ~0.1 s, on the
  card's own schedule) keep a point only when the counter moves, placed at the time the counter
  *updated* rather than when the move was seen. An update seen at read ``hi`` happened in
  ``(lo, hi]``, ``lo`` being the previous read; the updates come on a fixed period with an unknown
  phase, so the phase is estimated from the recent ``(lo, hi]`` intervals taken modulo the period
  (:class:`CounterPhase`: the phase interval agreed on by most of them, which ignores a missed or late
  update and read jitter). Until the phase is pinned down, and for an update that does not fit it, the
  point goes at the time of the read that saw the move. A counter that does not move for
  :data:`STALE_COUNTER_PERIODS` periods gets a point anyway (real zero power), at the update it skipped
  when the phase is known, so that windows over an idle device still resolve.

The energy at ``t`` is known (:meth:`SensorSeries.covers`) only once a point at or after ``t`` exists:
with counter points at their update times that is the first update after ``t``, not the first read.

:func:`window_bound_J` gives each window's attribution bound (formula in its docstring).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from lightning_energy.sensors.base import Sensor

# A quiet counter still gets a point after this many update periods, so zero power stays resolvable.
STALE_COUNTER_PERIODS = 1.5
READ_SLACK_S = 1e-6  # a tick due exactly at a sensor's read interval still reads it
# Counter phase estimate: the last PHASE_WINDOW update intervals vote; at least PHASE_MIN_AGREEING of them,
# and more than half, must share a phase. PHASE_TOLERANCE (a fraction of the period) widens every interval
# and every expected update time for read latency, the card's own update jitter and period drift.
PHASE_WINDOW = 16
PHASE_MIN_AGREEING = 3
PHASE_TOLERANCE = 0.02
# The estimate widens by this fraction of the period per period elapsed (500 ppm, 50 us per 0.1 s), so a
# card whose period differs a little from the nominal one (its own clock, "about 0.1 s") stays followed.
PHASE_DRIFT = 0.0005


class CounterPhase:
    """Phase of a counter that updates every ``period_s`` seconds on its own schedule.

    Each observed update adds the interval ``(lo, hi]`` in which it happened. Taken modulo the period,
    every interval is an arc of the circle ``[0, period)`` that holds the phase (widened by
    :data:`PHASE_TOLERANCE` on both sides). The first estimate is the part of the circle covered by the
    most of the recent arcs, accepted when at least :data:`PHASE_MIN_AGREEING` of them, and more than
    half, agree on it and no disjoint part is covered as often. From then on every arc that agrees with
    the estimate narrows it (their intersection), down to the spacing of the reads that fell closest to
    the update on either side (reads wander in phase: jitter, a read interval that does not divide the
    period), while it widens by :data:`PHASE_DRIFT` per period so that it follows a card whose period is
    a little off the nominal one; an arc that disagrees (a late or skipped update) is ignored, unless the recent arcs mostly
    disagree (the schedule moved), which starts a fresh estimate from the recent arcs.
    """

    def __init__(self, period_s: float) -> None:
        self.period_s = float(period_s)
        self.tolerance_s = PHASE_TOLERANCE * self.period_s
        self._arcs: deque[tuple[float, float]] = deque(maxlen=PHASE_WINDOW)  # (start phase, length), s
        self._agrees: deque[bool] = deque(maxlen=PHASE_WINDOW)  # whether each recent arc fit the estimate
        self._region: tuple[float, float] | None = None  # (start phase, width) holding the phase
        self._last_hi = math.inf  # time of the last update's read
        self.center_s: float | None = None  # phase of the updates in [0, period), once pinned down
        self.half_width_s = math.inf  # the phase is within center_s ± half_width_s

    @property
    def pinned(self) -> bool:
        return self.center_s is not None

    def add_update(self, lo: float, hi: float) -> None:
        """Record that the counter updated at some time in ``(lo, hi]`` (s)."""
        length = hi - lo + 2.0 * self.tolerance_s
        if not length < self.period_s:  # an interval as long as the period says nothing about the phase
            return
        arc = ((lo - self.tolerance_s) % self.period_s, length)
        self._arcs.append(arc)
        elapsed, self._last_hi = hi - self._last_hi, hi
        if self._region is not None:
            grow = PHASE_DRIFT * max(elapsed, 0.0)
            start, width = self._region
            if width + 2.0 * grow < self.period_s:
                self._set(((start - grow) % self.period_s, width + 2.0 * grow))
            narrowed = self._intersect(self._region, arc)
            self._agrees.append(narrowed is not None)
            if narrowed is not None:
                self._set(narrowed)
                return
            recent = list(self._agrees)[-PHASE_MIN_AGREEING:]
            if len(recent) < PHASE_MIN_AGREEING or any(recent):
                if 2 * sum(self._agrees) >= len(self._agrees):
                    return  # an odd update (late, skipped): the estimate stands
            # the schedule moved: start afresh from the updates that left the old estimate
            arcs = list(self._arcs)[-PHASE_MIN_AGREEING:]
            self._arcs.clear()
            self._arcs.extend(arcs)
        self._agrees.clear()
        self._set(self._deepest())

    def _set(self, region: tuple[float, float] | None) -> None:
        self._region = region
        if region is None:
            self.center_s, self.half_width_s = None, math.inf
        else:
            self.center_s = (region[0] + region[1] / 2.0) % self.period_s
            self.half_width_s = region[1] / 2.0

    def _ahead(self, x: float, y: float) -> float:
        """How far phase ``x`` lies ahead of phase ``y`` around the circle, in [0, period)."""
        d = (x - y) % self.period_s
        return 0.0 if d >= self.period_s * (1.0 - 1e-9) else d  # rounding of equal phases

    def _intersect(self, a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float] | None:
        """The (larger) common part of two arcs ``(start, width)``, or None."""
        pieces = []
        d = self._ahead(b[0], a[0])
        if d <= a[1]:
            pieces.append((b[0], min(a[1] - d, b[1])))
        e = self._ahead(a[0], b[0])
        if e <= b[1]:
            pieces.append((a[0], min(b[1] - e, a[1])))
        return max(pieces, key=lambda p: p[1]) if pieces else None

    def _deepest(self) -> tuple[float, float] | None:
        """The region covered by the most recent arcs, if enough of them agree on one."""
        period, arcs, ahead = self.period_s, self._arcs, self._ahead
        # The deepest point of a set of arcs can be taken at the start of one of them: for each start,
        # count the arcs holding it; the region is then [start, start + the least room left in them].
        candidates = []
        for start, _ in arcs:
            count, width = 0, period
            for s, length in arcs:
                d = ahead(start, s)
                if d <= length:
                    count += 1
                    width = min(width, length - d)
            candidates.append((count, -width, start))
        count, neg_width, start = max(candidates)
        width = -neg_width
        for other_count, other_neg_width, other_start in candidates:
            disjoint = ahead(other_start, start) > width and ahead(start, other_start) > -other_neg_width
            if other_count == count and disjoint:
                return None  # two disjoint phases agreed on as often: ambiguous
        if count >= PHASE_MIN_AGREEING and 2 * count > len(arcs):
            return (start, width)
        return None

    def expected_update(self, t: float) -> float:
        """The expected update time (s) nearest to time ``t`` (requires :attr:`pinned`)."""
        return self.center_s + round((t - self.center_s) / self.period_s) * self.period_s

    def window_s(self) -> float:
        """Half-width (s) of the window around an expected update time within which it happens."""
        return self.half_width_s + self.tolerance_s


@dataclass(frozen=True)
class EdgeBound:
    """What a series knows about the cumulative energy at one time (one edge of a window).

    ``energy_J``: the figure (:meth:`SensorSeries.energy_at`). Counters: the true cumulative energy is
    within ``[low_J, high_J]`` (``high_J`` is ``inf`` while no update known to come after the time has
    been seen). Power sensors: ``low_J == high_J == energy_J`` and ``swing_J`` is the running sum of
    ``Δt × |ΔP| / 2`` over the sample intervals up to the time (see :func:`window_bound_J`).
    """

    energy_J: float
    low_J: float
    high_J: float
    swing_J: float = 0.0
    resolution_J: float = 0.0


class SensorSeries:
    """Points of one sensor; touched only under the sampler's lock.

    Public data: ``times`` and ``energies`` (the points), ``power_w`` (latest power), ``fields``,
    ``failure``/``failed_at``; ``trace_energy_J`` is the cumulative energy to write in the trace for the
    latest reading (the counter's value when that reading added a point, NaN between counter updates;
    the integral for power sensors).
    """

    def __init__(self, sensor: Sensor) -> None:
        self.sensor = sensor
        self.name = sensor.name
        self.kind = sensor.kind
        self.times: list[float] = []
        self.energies: list[float] = []
        # per point: earliest and latest time at which a counter's update can have happened (for power
        # sensors and exact counters both equal the point's time) and the running swing sum (power)
        self.update_early: list[float] = []
        self.update_late: list[float] = []
        self._swing: list[float] = []
        self.power_w = math.nan  # latest power, W (read, or derived from the last two points)
        self.fields: dict[str, float] = {}
        self.failure: str | None = None
        self.failed_at: float | None = None
        self.trace_energy_J = math.nan
        self.phase: CounterPhase | None = None
        self._last_read: float | None = None
        self._last_read_t = -math.inf

    def read_recently(self, t: float) -> bool:
        """True if the sensor asks for fewer reads and its last one is younger than that interval."""
        interval = self.sensor.min_read_interval_s
        return interval is not None and bool(self.times) and t - self._last_read_t < interval - READ_SLACK_S

    @property
    def live(self) -> bool:
        return self.failure is None

    @property
    def last_time_s(self) -> float | None:
        """Time (s, sampler clock) of the last point: for a failed sensor, its last good sample."""
        return self.times[-1] if self.times else None

    @property
    def last_energy_J(self) -> float | None:
        """Cumulative energy (J) at the last point; a failed sensor's figure stays there for good."""
        return self.energies[-1] if self.energies else None

    @property
    def last_read_s(self) -> float | None:
        """Time (s) of the latest reading (for counters it may be later than the last point)."""
        return self._last_read_t if math.isfinite(self._last_read_t) else None

    def _append(self, t: float, energy: float, early: float, late: float, swing: float = 0.0) -> None:
        self.times.append(t)
        self.energies.append(energy)
        self.update_early.append(early)
        self.update_late.append(late)
        self._swing.append(swing)

    def add_reading(self, t: float, value: float) -> None:
        """Add one reading taken at time ``t``: joules for counters, watts for power sensors."""
        previous_read_t, self._last_read_t = self._last_read_t, t
        self.trace_energy_J = math.nan
        if not math.isfinite(value):
            raise ValueError(f"sensor returned a non-finite value: {value!r}")
        if self.kind == "power":
            if value < 0:
                raise ValueError(f"sensor returned a negative power: {value} W")
            if self.times:
                dt = t - self.times[-1]
                energy = self.energies[-1] + dt * (self.power_w + value) / 2.0
                swing = self._swing[-1] + dt * abs(value - self.power_w) / 2.0
            else:
                energy, swing = 0.0, 0.0
            self._append(t, energy, t, t, swing)
            self.power_w = value
            self.trace_energy_J = energy
            return
        if self._last_read is not None and value < self._last_read:
            raise ValueError(f"energy counter went backwards ({self._last_read} J -> {value} J)")
        self._last_read = value
        period = self.sensor.counter_update_period_s
        if period is not None and not period > 0:
            period = None
        if not self.times:
            # the value is that of the counter's last update, some time within the period before t
            self._append(t, value, t - period if period else t, t)
            self.trace_energy_J = value
            return
        if period is None:  # a counter exact at every reading
            dt = t - self.times[-1]
            self.power_w = (value - self.energies[-1]) / dt if dt > 0 else self.power_w
            self._append(t, value, t, t)
            self.trace_energy_J = value
            return
        if self.phase is None or self.phase.period_s != period:
            self.phase = CounterPhase(period)
        if value != self.energies[-1]:
            if previous_read_t < t:
                self.phase.add_update(previous_read_t, t)
            u, early, late = self._place_update(previous_read_t, t, period)
        elif t - self.times[-1] >= STALE_COUNTER_PERIODS * period:
            u, early, late = self._place_stale(t, period)
        else:
            return
        dt = u - self.times[-1]
        self.power_w = (value - self.energies[-1]) / dt if dt > 0 else self.power_w
        self._append(u, value, early, late)
        self.trace_energy_J = value

    def _place_update(self, lo: float, hi: float, period: float) -> tuple[float, float, float]:
        """Time of the update seen at ``hi`` (previous read at ``lo``) and the span it lies in."""
        prev = self.times[-1]
        phase = self.phase
        if phase.pinned and math.isfinite(lo):
            w = phase.window_s()
            g = phase.expected_update(hi)
            best = None
            for candidate in (g + period, g, g - period):  # the expected update that fits (lo, hi] best
                early, late = max(candidate - w, lo), min(candidate + w, hi)
                if early <= late and (best is None or late - early > best[2] - best[1]):
                    best = (candidate, early, late)
            if best is not None:
                candidate, early, late = best
                u = candidate if lo < candidate <= hi else (early + late) / 2.0
                if u > prev:
                    return u, early, late
        # not pinned down, or an update off the schedule: the time of the read that saw it
        return hi, max(lo, hi - period, prev), hi

    def _place_stale(self, t: float, period: float) -> tuple[float, float, float]:
        """Where a point goes for a counter that has not moved for a while (zero power)."""
        phase = self.phase
        prev = self.times[-1]
        if phase.pinned:
            w = phase.window_s()
            g = phase.expected_update(t)
            while g + w > t:  # the latest expected update that has surely happened by t
                g -= period
            if g > prev:
                return g, g - w, g + w
        return t, t - period, t

    def covers(self, t: float) -> bool:
        """True when the energy at time ``t`` is known (a point at or after ``t`` exists)."""
        return bool(self.times) and self.times[-1] >= t

    def energy_at(self, t: float) -> float | None:
        """Cumulative energy (J) at time ``t`` by linear interpolation; None if not covered."""
        times = self.times
        if not times or t > times[-1]:
            return None
        if t <= times[0]:
            return self.energies[0]
        i = bisect.bisect_left(times, t)
        t1, e1 = times[i], self.energies[i]
        t0, e0 = times[i - 1], self.energies[i - 1]
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def edge_bound(self, t: float) -> EdgeBound | None:
        """What is known of the cumulative energy at ``t`` (None outside the points); see :class:`EdgeBound`.

        Record it when a window edge resolves (points before the oldest pending mark are trimmed) and
        combine two with :func:`bound_between`.
        """
        times = self.times
        if not times or t < times[0] or t > times[-1]:
            return None
        energy = self.energy_at(t)
        if self.kind == "power":
            if t <= times[0]:
                swing = self._swing[0]
            else:
                i = bisect.bisect_left(times, t)
                t0, t1 = times[i - 1], times[i]
                swing = self._swing[i - 1] + (self._swing[i] - self._swing[i - 1]) * (t - t0) / (t1 - t0)
            return EdgeBound(energy, energy, energy, swing)
        # counters: the last point whose update surely happened by t, the first one surely after t
        low = -math.inf
        for j in range(bisect.bisect_right(times, t) - 1, -1, -1):
            if self.update_late[j] <= t:
                low = self.energies[j]
                break
        high = math.inf
        for k in range(bisect.bisect_left(times, t), len(times)):
            if self.update_early[k] >= t:
                high = self.energies[k]
                break
        resolution = getattr(self.sensor, "counter_resolution_J", None) or 0.0
        return EdgeBound(energy, low, high, 0.0, float(resolution))

    def extrapolate(self, t: float) -> float | None:
        """Energy at ``t`` past the last point, continuing the last known power (flagged by callers)."""
        if not self.times:
            return None
        if t <= self.times[-1]:
            return self.energy_at(t)
        power = self.power_w if math.isfinite(self.power_w) else 0.0
        return self.energies[-1] + power * (t - self.times[-1])

    def trim_before(self, t: float, keep_at_least: int) -> None:
        """Forget points older than the one just before ``t`` while keeping ``keep_at_least`` points."""
        cut = bisect.bisect_left(self.times, t) - 1
        cut = min(cut, len(self.times) - keep_at_least)
        if cut > 0:
            del self.times[:cut]
            del self.energies[:cut]
            del self.update_early[:cut]
            del self.update_late[:cut]
            del self._swing[:cut]


def bound_between(start: EdgeBound | None, end: EdgeBound | None) -> float:
    """Attribution bound (J) of the window between two edges of one sensor (``inf`` if either is None).

    See :func:`window_bound_J` for the formula.
    """
    if start is None or end is None:
        return math.inf
    estimate = end.energy_J - start.energy_J
    low = max(0.0, end.low_J - start.high_J)
    high = end.high_J - start.low_J
    spread = max(estimate - low, high - estimate, 0.0)
    return spread + (end.swing_J - start.swing_J) + start.resolution_J + end.resolution_J


def window_bound_J(series: SensorSeries, start_s: float, end_s: float) -> float:
    """Bound (J) on the attribution error of the energy of ``[start_s, end_s]`` as the series reports it.

    It covers how the energy is shared out in time between the sensor's readings (what happens between
    two samples, where a counter update falls); not the sensor's own accuracy (a power reading's error,
    NVML's ±5 %, an estimated sensor's model). ``inf`` when an edge lies outside the points (before the
    first one, or past the last one: an extrapolated edge), so record :meth:`SensorSeries.edge_bound`
    when each edge resolves.

    Power sensors (readings ``P_i`` at ``t_i``, integrated by the trapezoid rule and interpolated
    linearly, i.e. at the mean of the two readings over each sample interval): assuming the power inside
    a sample interval stays between the readings at its two ends (at most one change, or a ramp, between
    two samples), each sample interval overlapping the window by ``L_i`` seconds is off by at most
    ``L_i × |P_{i+1} − P_i| / 2``::

        bound = Σ_i  L_i × |P_{i+1} − P_i| / 2

    For a window whose power changes only at its edges this is the two edge terms: at most one sampling
    interval × the power swing across each edge / 2 (the trapezoid puts a step mid-interval); constant
    power gives 0. Changes inside a long window count too, at their worst case: their errors have random
    signs, so a long window is usually far closer than this sum. Power that changes several times within
    one sampling interval (steps shorter than the interval) breaks the assumption: the readings cannot
    see it, and no bound drawn from them can (``benchmarks/fidelity.py`` reports how often the bound
    holds on each trace).

    Counters: a counter's value at an update is the true cumulative energy then, and cumulative energy
    never decreases. Each point's update happened within a known span (its phase uncertainty, or the
    interval between the read that did not see it and the one that did), so the true cumulative energy
    at an edge ``x`` lies in ``[L(x), H(x)]``: ``L`` the value of the last update surely at or before
    ``x``, ``H`` that of the first surely after it (one counter granularity, the energy of one update,
    wide when the update times are known). With the estimate ``Ê = E(end) − E(start)``::

        bound = max(Ê − max(0, L(end) − H(start)),  H(end) − L(start) − Ê) + 2 × counter_resolution_J

    (``counter_resolution_J``: an optional sensor attribute, the counter's unit, e.g. 1 mJ for NVML; 0 if
    absent.)
    """
    if end_s < start_s:
        raise ValueError(f"window ends before it starts: [{start_s}, {end_s}]")
    return bound_between(series.edge_bound(start_s), series.edge_bound(end_s))
