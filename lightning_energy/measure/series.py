"""Cumulative-energy series of one sensor: the points the sampler keeps and interpolation over them.

Every sensor becomes a list of (time s, cumulative energy J) points; a window's energy is the difference
of the linear interpolation of these points at its two edges. It is one function of time for all
windows: consecutive windows add up exactly (steps + gaps = epoch) and a covered time's figure never
changes (:meth:`SensorSeries.covers`).

**Boundary rule.** Power changes where the work changes: at the Meter's marks (step, epoch and loop
boundaries). The sampler passes the times of its meters' pending marks with every reading
(``add_reading(t, value, breakpoints=...)``; host marks have their time at once, a device mark only once
the device reached it), and each series puts the change of power of a sample interval (power sensors) or
counter period (counters) at the marks inside it rather than spreading it evenly. Marks closer together
than :data:`MARK_CLUSTER_S` (5 ms) are one step boundary (:func:`boundaries`): Lightning places two at
every step boundary (the step's end, then the next step's start 0.5-3 ms later) and more at epoch and loop
boundaries, and the rules below count boundaries, not marks (each boundary one change of power, at its
middle where a rule needs one point; each of its marks then gets the power of the side it is nearer):

- Power sensors (reading ``P0`` at ``t0``, ``P1`` at ``t1``): zero-order hold with one change. The
  trapezoid rule is this rule with the change at the middle of the interval, and it stays so without a
  mark inside ``(t0, t1)`` (one point at ``t1``). With boundaries ``b1 <= ... <= bL`` inside, ``P0`` holds until
  ``b1`` and ``P1`` from ``bL`` on (points at ``b1``, ``bL`` and ``t1``): exact when the power changes at
  one mark of the interval. Why the first mark: under the assumption the power read at ``t0`` holds
  until the next boundary, and the power read at ``t1`` has held since the last one; between them
  (several boundaries in one interval: steps or gaps shorter than the sampling interval) the readings
  say nothing and that stretch gets their mean ``(P0 + P1) / 2``, the trapezoid's own value. With one
  mark, "the first" and "the last" are the same point. Two equal readings around several marks
  (steps shorter than the interval) are held as they are, with points at the first and the last mark.
  Between the first and the last mark of an interval the readings see nothing: the power may have
  changed at each mark (steps shorter than the sampling interval), so the bound there spans the range
  of powers read so far; the figure's error there is the sampling's own (aliasing: the readings
  sample one power in two or three steps), which no placement removes (measured against the best
  estimate from the same readings in ``benchmarks/fidelity.py``: read faster, ``interval_s``).
  Cost on ramps (the assumption does not hold): the trapezoid is exact at the samples of a linear ramp; a
  change put at a mark ``b`` is off by ``k × Δt × (b − mid)`` over the interval (``k`` the slope: at most
  ``k × Δt² / 2``), and these add up over an epoch. So a change that continues the trend of the interval
  before is not a step: the change point moves from ``mid`` towards the marks by ``1 − k_prev / k``
  clamped to [0, 1] (:func:`ramp_weight`; ``k_prev``, ``k`` the slopes of the interval before and of this
  one). A step after a flat interval (or after one whose change went to a mark) gets the marks; a
  linear ramp the trapezoid, exact at its samples again. Where the assumption fails otherwise (power
  changing off the marks), an interval is off by at most ``Δt × |P1 − P0|``, twice the trapezoid's worst
  case; measured in ``benchmarks/fidelity.py``.
- Counters that only advance every ``counter_update_period_s`` (NVML's energy counter: ~0.1 s, on the
  card's own schedule) keep a point only when the counter moves, placed at the time the counter
  *updated* rather than when the move was seen. An update seen at read ``hi`` happened in
  ``(lo, hi]``, ``lo`` being the previous read; the updates come on a fixed period with an unknown
  phase, so the phase is estimated from the recent ``(lo, hi]`` intervals taken modulo the period
  (:class:`CounterPhase`: the phase interval agreed on by most of them, which ignores a missed or late
  update and read jitter). Until the phase is pinned down the point goes in the middle of ``(lo, hi]``,
  where the pinned estimate starts out (at ``hi`` it sat half a read interval later than the placements
  after pinning, which put that much energy into the windows across); an update that does not fit the
  pinned phase (late, after a skipped one), or reads slower than the counter, at the read that saw it.
  The first reading's value is that of an update within the period before it: its point moves back to
  the update one period before the next one once that is placed (within the first read's span), and until
  then nothing after the earliest time it may move to is covered. (At its read, the first 0.35 s after
  acquisition read +14 % on average, +27 % at worst, at a constant 200 W through the Sampler with the
  fake NVML, 60 phases and draws of 50 ms + 0-2 ms reads; now -0.3 % on average, -0.9 to +5.8 %.)
  A counter that does not move for :data:`STALE_COUNTER_PERIODS` periods gets a point anyway (real zero
  power), at the update it skipped when the phase is known, so that windows over an idle device still
  resolve. Counters without a known
  period add a point per reading, at the time of the reading.
- Counters, boundary rule: between two counter points the power is constant (linear interpolation), except
  in a period ``(u0, u1)`` that holds a boundary while the periods before and after it hold none (a
  boundary is in the period holding its middle: the two marks of one boundary across an update do not
  make the period after a neighbour with marks). Then, by the assumption, the power before the first mark
  ``b1`` of its boundaries is that of the period before (``Pb``) and after the last one ``bL`` that of the
  period after (``Pa``); the period's own energy ``E`` (exact: the
  counter's) is kept. One mark: the energy at it is ``e0 + Pb (b − u0)`` or ``e1 − Pa (u1 − b)``, the two
  agreeing on an exact step; each is weighted by how little it relies on its power (``(u1 − b)/(u1 − u0)``
  for the first), which also shares out the error of a placed update time. Several marks (one boundary's
  two, or several boundaries): points at ``b1`` and ``bL`` from each side, linear between (each exact for
  a step anywhere between them). The figure is clamped into ``[e0, e1]`` (power never
  negative), and the period stays linear where the rebuilt step could not hold: ``E / (u1 − u0)`` not
  between ``Pb`` and ``Pa``, or the two sides overlapping. It needs the update *after* the period: a mark
  in such a period resolves one counter point later (one update period, 0.1 s for NVML), and ``covers``
  says so. From the mark that is at most two periods and a read while the counter moves (0.25 s for NVML
  read at 20 Hz), three if it stops right after the mark (the period after then ends at the staleness
  point: 0.30 s), within ``Sampler.resolution_timeout_s`` (0.35 s at those settings). A period whose
  neighbours hold boundaries (steps shorter than about two update periods) stays linear: nothing then says
  where inside it the work changed. On a ramp the neighbours' averages are not the power at the period's
  edges and the figure at a mark is off by up to 9/32 × ``k × period²`` (``k`` the slope); unlike power sensors
  there is no ramp test, as a slope drawn from period averages is too noisy (tried: it cost more on noisy
  steps than it saved on ramps).

- Counters with a power reading (NVML on A100/H100/H200: ``shape_window_s``; the model, its constants and
  the run-time check of the card's schedule are in :mod:`lightning_energy.measure.shaping`): the sampler
  passes the power field with every reading; once its refresh phase is pinned, each window it averaged is
  placed (where the run's own readings put it: :class:`~lightning_energy.measure.shaping.WindowPlacement`,
  fed every final counter period with its boundaries), and every period that holds marks waits for the
  update after it and is shared out by
  :func:`segment_powers` (one power per segment between step boundaries over the periods before, of and
  after it, fitted to their exact energies and their windows; the period's exact energy shared out in
  proportion, so every counter update keeps its value). With more segments than readings (steps shorter
  than about a third of a period), before the phase is pinned, or once the card is found not to follow the
  model (:attr:`SensorSeries.shaping` says which), the neighbour rule above applies. The bound stays the
  counter's (it does not rely on this rule). A window that holds a boundary mixes the two segments by where
  it is placed; steps locked to the readings' schedule (steps of exactly one period) leave the windows
  saying little more than the periods, and a few ms of placement then move the figures. Measured on the
  fake H200 (``benchmarks/shaping_phases.py``: 19 refresh phases, reads every 50 ms + 0-2 ms, instant or
  2.4 ms counter reads, 50/150 W steps; median step error over the phases): steps of 70-130 ms 0.4-0.65 %
  with one mark per boundary and 0.8-1.15 % with Lightning's two (0.5-3 ms apart; the power changing at
  the first: half the gap goes to the wrong side), single steps off by 12-17 % at most per run
  (median over runs); exact 100 ms steps 0.2-0.5 %, but 15-44 % at the worst locked phase, where the
  figures move with every draw of the read times. ``benchmarks/fidelity.py`` (one mark per boundary, 100 ms
  square wave): 0.28 % median, 1.4 % p95. Through real fits on hardware that differs from this model
  (``benchmarks/end_to_end_truth.py``; the README's accuracy table): 100 ms +-30 % steps 0.5-4 % median
  over 8 drawn phases, lags and window lengths, once the refresh phase is pinned.

The energy at ``t`` is known (:meth:`SensorSeries.covers`) only once the points around ``t`` are final: a
point at or after ``t`` exists and, for a counter, ``t`` is not in a period still waiting for the update
after it. Points are appended, or inserted (counters' rebuilt steps) only after the last covered time.

:func:`window_bound_J` gives each window's attribution bound (formula in its docstring): it does not rely
on the boundary rule's assumption.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.shaping import (  # noqa: F401 (re-exported: the series' public names)
    SHAPE_PLACEMENT_S,
    SHAPE_PRIOR_WEIGHT,
    SHAPE_WINDOWS_KEPT,
    ShapeReading,
    segment_powers,
    shape_lag_s,
    shape_window_s,
)

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
# Marks closer together than this form one step boundary (one change of power) for the boundary rule:
# Lightning places two marks at every step boundary (a step's end and the next step's start, 0.5-3 ms apart)
# and more at epoch and loop boundaries. 5 ms is well under anything the readings resolve (a 50 ms sampling
# interval, the 25 ms NVML power window, the 100 ms counter period) and over the gap between such marks.
MARK_CLUSTER_S = 0.005


def boundaries(marks) -> list[tuple[float, float]]:
    """The step boundaries among ``marks`` (times, s): ``(first, last)`` mark of each group of marks that
    lie within :data:`MARK_CLUSTER_S` of the group's first one, in time order. The rules put a boundary's
    one change of power at its middle, ``(first + last) / 2``: each mark of it then gets the power of the
    side it is nearer."""
    out: list[tuple[float, float]] = []
    for m in sorted(marks):
        if out and m - out[-1][0] <= MARK_CLUSTER_S:
            out[-1] = (out[-1][0], m)
        else:
            out.append((m, m))
    return out


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


def ramp_weight(previous: tuple[float, float, bool] | None, t0: float, p0: float, dt: float, dp: float) -> float:
    """How far (0..1) a power change ``dp`` over ``(t0, t0 + dt)`` moves from mid-interval to its marks.

    1 for a step: the interval before (``previous``: its start time and reading, and whether its own change
    went to a mark) was flat, or went the other way, or its change was put at a mark (a boundary, not a
    ramp). On a ramp the interval before already moved the same way: with slopes ``k_prev`` and ``k``,
    the weight is ``1 − k_prev / k`` clamped to [0, 1], 0 (the trapezoid, exact at the samples of a linear
    ramp) once the power rose (or fell) as fast before as across this interval.
    """
    if previous is None:
        return 1.0
    t_prev, p_prev, marked = previous
    if marked or not t0 > t_prev:
        return 1.0
    ratio = ((p0 - p_prev) / (t0 - t_prev)) / (dp / dt)
    return min(max(1.0 - ratio, 0.0), 1.0)


@dataclass(frozen=True)
class EdgeBound:
    """What a series knows about the cumulative energy at one time (one edge of a window).

    ``energy_J``: the figure (:meth:`SensorSeries.energy_at`). Counters: the true cumulative energy is
    within ``[low_J, high_J]`` (``high_J`` is ``inf`` while no update known to come after the time has
    been seen). Power sensors: ``low_J == high_J == energy_J``; ``over_J`` and ``under_J`` are running
    sums, up to the time, of how much the true energy can exceed (fall short of) the figure in each
    stretch between points (see :func:`window_bound_J`).
    """

    energy_J: float
    low_J: float
    high_J: float
    over_J: float = 0.0
    under_J: float = 0.0
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
        # sensors and exact counters both equal the point's time; a counter's rebuilt step, which is no
        # reading, has (-inf, inf)) and, for power sensors, the running sums of the bound (EdgeBound)
        self.update_early: list[float] = []
        self.update_late: list[float] = []
        self._over: list[float] = []
        self._under: list[float] = []
        self.power_w = math.nan  # latest power, W (read, or derived from the last two points)
        self.fields: dict[str, float] = {}
        self.failure: str | None = None
        self.failed_at: float | None = None
        self.trace_energy_J = math.nan
        self.phase: CounterPhase | None = None
        self._last_read: float | None = None
        self._last_read_t = -math.inf
        self._shape_from_s = -math.inf  # when the latest reading's shape power began to be read (s)
        # counters: the marks seen lately (the boundary rule looks at a period's neighbours), and whether
        # the last period waits for the next point (its marks' figures are not final yet)
        self._breaks: list[float] = []
        self._waiting = False
        # counters with a shape reading (see "Counters with a power reading"): its schedule and windows
        self.shape: ShapeReading | None = None
        self._first_read_s: float | None = None  # counters: when the first point's value was read
        self._previous: tuple[float, float, bool] | None = None  # power: (t, P) read before the last, marked
        self._power_range = (math.inf, -math.inf)  # power sensors: the lowest and highest reading so far, W

    def read_recently(self, t: float) -> bool:
        """True if the sensor asks for fewer reads and its last one is younger than that interval."""
        interval = self.sensor.min_read_interval_s
        return interval is not None and bool(self.times) and t - self._last_read_t < interval - READ_SLACK_S

    @property
    def live(self) -> bool:
        return self.failure is None

    @property
    def last_time_s(self) -> float | None:
        """Time (s, sampler clock) up to which the figures are final (:meth:`covers`): the last point, or
        the one before it while a counter period waits for the update after it, or, while a counter with a
        period has only its first point, the earliest time that point may move back to (the update its
        value came from, placed once the next one is); for a failed sensor, its last good sample (a waiting
        period then stays linear)."""
        if not self.times:
            return None
        if self._first_read_s is not None and self.failure is None:
            return self.update_early[0]  # the first point may still move back to here
        return self.times[-2] if self._waiting and self.failure is None else self.times[-1]

    @property
    def shaping(self) -> str | None:
        """How this counter's periods are shared out around step boundaries, in a few words: "shaped by
        power_W (window 25 ms, lag 11 ms)", or "plain counter rule: <why>" where the sensor's power reading
        does not follow the model (see :mod:`lightning_energy.measure.shaping`). None for sensors without a
        power reading to shape by (or before its first reading)."""
        return self.shape.status if self.shape is not None else None

    @property
    def shape_phase(self) -> CounterPhase | None:
        """The refresh phase of the power reading (counters with one), or None."""
        return self.shape.phase if self.shape is not None else None

    @property
    def _windows(self) -> tuple[tuple[float, float, float], ...]:
        """The power reading's latest windows ``(start s, end s, W)``, the latest last."""
        return tuple(self.shape.windows) if self.shape is not None else ()

    @property
    def last_energy_J(self) -> float | None:
        """Cumulative energy (J) at the last point; a failed sensor's figure stays there for good."""
        return self.energies[-1] if self.energies else None

    @property
    def last_read_s(self) -> float | None:
        """Time (s) of the latest reading (for counters it may be later than the last point)."""
        return self._last_read_t if math.isfinite(self._last_read_t) else None

    def _append(self, t: float, energy: float, early: float, late: float, over: float = 0.0,
                under: float = 0.0) -> None:
        self.times.append(t)
        self.energies.append(energy)
        self.update_early.append(early)
        self.update_late.append(late)
        self._over.append(over)
        self._under.append(under)

    def add_reading(self, t: float, value: float, breakpoints=(), shape_w: float | None = None,
                    read_end_s: float | None = None, shape_from_s: float | None = None) -> None:
        """Add one reading taken at time ``t``: joules for counters, watts for power sensors.

        ``breakpoints``: times (s, any order) of the marks not resolved yet, up to ``t``: where the work,
        hence the power, may change (see the module's boundary rule). Marks already passed on are
        harmless; a mark left out (a device mark whose time is not known yet) leaves its interval to
        the midpoint (power) or linear (counter) rule.

        ``shape_w``: for a counter whose sensor has ``shape_window_s`` (see :func:`shape_window_s`), the
        power reading (W) read along with the counter: the mean over the window that ends ``shape_lag_s``
        before the reading's latest refresh (refreshes are seen as changes of the value; see "Counters
        with a power reading").

        ``read_end_s``: when the sensor's read (with its fields) returned, if later than ``t`` (an H200's
        counter read takes 2.4 ms): a counter update or a refresh this reading shows happened by then, one
        the previous reading did not show after that reading's ``t``.

        ``shape_from_s``: when the read of ``shape_w`` began, if later than ``t`` (NVML reads it after the
        counter, 0.1-20 ms later): a refresh this reading's ``shape_w`` did not show happened after it, which
        narrows the next reading's span for the refresh (see :meth:`ShapeReading.add`).
        """
        previous_read_t, self._last_read_t = self._last_read_t, t
        shape_lo = self._shape_from_s if math.isfinite(self._shape_from_s) else previous_read_t
        self._shape_from_s = t if shape_from_s is None else max(t, shape_from_s)
        seen_by = t if read_end_s is None else max(t, read_end_s)
        self.trace_energy_J = math.nan
        if not math.isfinite(value):
            raise ValueError(f"sensor returned a non-finite value: {value!r}")
        if self.kind == "power":
            if value < 0:
                raise ValueError(f"sensor returned a negative power: {value} W")
            self._add_power(t, value, breakpoints)
            return
        if self._last_read is not None and value < self._last_read:
            raise ValueError(f"energy counter went backwards ({self._last_read} J -> {value} J)")
        self._last_read = value
        self._note_breaks(breakpoints)
        period = self.sensor.counter_update_period_s
        if period is not None and not period > 0:
            period = None
        shaped_by = shape_w if period is not None and shape_window_s(self.sensor) is not None else None
        if shaped_by is not None and math.isfinite(shaped_by):
            if self.shape is None or self.shape.period_s != period:
                self.shape = ShapeReading(self.sensor, period, CounterPhase)
            self.shape.add(shape_lo, seen_by, float(shaped_by))
        if not self.times:
            # the value is that of the counter's last update, some time within the period before it was read;
            # with a period, the point moves to that update once the next one is placed (_retime_first_point)
            self._append(t, value, seen_by - period if period else t, t)
            self._first_read_s = seen_by if period else None
            self.trace_energy_J = value
            return
        if period is None:  # a counter exact at every reading
            dt = t - self.times[-1]
            self.power_w = (value - self.energies[-1]) / dt if dt > 0 else self.power_w
            self._append(t, value, t, t)
            self._counter_point_added()
            self.trace_energy_J = value
            return
        if self.phase is None or self.phase.period_s != period:
            self.phase = CounterPhase(period)
        if value != self.energies[-1]:
            if previous_read_t < seen_by:
                self.phase.add_update(previous_read_t, seen_by)
            u, early, late = self._place_update(previous_read_t, seen_by, period)
        elif t - self.times[-1] >= STALE_COUNTER_PERIODS * period:
            u, early, late = self._place_stale(t, period)
        else:
            return
        if self._first_read_s is not None:
            self._retime_first_point(u, early, late, period, moved=value != self.energies[-1])
        dt = u - self.times[-1]
        self.power_w = (value - self.energies[-1]) / dt if dt > 0 else self.power_w
        self._append(u, value, early, late)
        self._counter_point_added()
        self.trace_energy_J = value

    # --- power sensors: zero-order hold, the change at the marks (mid-interval without one, or on a ramp) ---
    def _add_power(self, t: float, value: float, breakpoints) -> None:
        previous, self._previous = self._previous, None
        low, high = self._power_range
        self._power_range = (min(low, value), max(high, value))
        if not self.times:
            self._append(t, 0.0, t, t)
            self.power_w = value
            self.trace_energy_J = 0.0
            self._previous = (t, value, False)
            return
        t0, e0, p0 = self.times[-1], self.energies[-1], self.power_w
        over, under = self._over[-1], self._under[-1]
        dt, dp = t - t0, value - p0
        # one change per step boundary (a group of close marks: Lightning's step end and next step start)
        inside = [(a + b) / 2.0 for a, b in boundaries(b for b in breakpoints if t0 < b < t)] if dt > 0 else []
        if dp == 0.0 and len(inside) >= 2:
            # equal readings around several marks: the power held, or changed and came back unseen
            # between the first mark and the last (steps shorter than the sampling interval)
            b1, bl = inside[0], inside[-1]
            self._append(b1, e0 + p0 * (b1 - t0), b1, b1, over, under)
            over += (self._power_range[1] - p0) * (bl - b1)
            under += (p0 - self._power_range[0]) * (bl - b1)
            self._append(bl, e0 + p0 * (bl - t0), bl, bl, over, under)
            inside = []
        weight = ramp_weight(previous, t0, p0, dt, dp) if inside and dp != 0.0 else 0.0
        if weight > 0.0:
            # the change at the marks (pulled towards mid-interval on a ramp): P0 until the first, P1 from
            # the last, their mean in between; truth - figure stays within [min(0, ±dp), max(0, ±dp)] where
            # the figure holds a reading (power between the two readings), within ±|dp|/2 where it holds
            # their mean
            mid = t0 + dt / 2.0
            c1, cl = mid + weight * (inside[0] - mid), mid + weight * (inside[-1] - mid)
            e1 = e0 + p0 * (c1 - t0)
            over, under = over + max(dp, 0.0) * (c1 - t0), under + max(-dp, 0.0) * (c1 - t0)
            self._append(c1, e1, c1, c1, over, under)
            if cl > c1:
                # several marks: the power between the first and the last may have changed at each of
                # them, unseen by the readings: the truth there lies within the range of powers read so far
                mean = (p0 + value) / 2.0
                e1 += mean * (cl - c1)
                over += max(self._power_range[1] - mean, abs(dp) / 2.0) * (cl - c1)
                under += max(mean - self._power_range[0], abs(dp) / 2.0) * (cl - c1)
                self._append(cl, e1, cl, cl, over, under)
            energy = e1 + value * (t - cl)
            over, under = over + max(-dp, 0.0) * (t - cl), under + max(dp, 0.0) * (t - cl)
        else:  # no mark inside, or a ramp: the trapezoid (the mean of the two readings all along)
            energy = e0 + dt * (p0 + value) / 2.0
            over, under = over + dt * abs(dp) / 2.0, under + dt * abs(dp) / 2.0
        self._append(t, energy, t, t, over, under)
        self.power_w = value
        self.trace_energy_J = energy
        self._previous = (t0, p0, weight > 0.0)

    # --- counters: a step rebuilt inside a period that holds marks -------------------------------------
    def _note_breaks(self, breakpoints) -> None:
        """Remember the marks after the point that starts the oldest period the rule may still look at (and
        those a boundary's width before it: they place that boundary)."""
        real = self._real_indices(3)
        floor = self.times[real[0]] - MARK_CLUSTER_S if len(real) >= 3 else -math.inf
        known = self._breaks
        if known and known[0] <= floor:
            del known[:bisect.bisect_right(known, floor)]
        for b in breakpoints:
            if b > floor:
                i = bisect.bisect_left(known, b)
                if i == len(known) or known[i] != b:
                    known.insert(i, b)

    def _marks_inside(self, lo: float, hi: float) -> list[float]:
        known = self._breaks
        return known[bisect.bisect_right(known, lo):bisect.bisect_left(known, hi)]

    def _boundaries_inside(self, lo: float, hi: float) -> list[float]:
        """Times (s) of the step boundaries in ``(lo, hi)``: the middle of each group of close marks
        (:func:`boundaries`), which is where the counter rules put its change of power."""
        return [m for m in ((first + last) / 2.0 for first, last in boundaries(self._breaks)) if lo < m < hi]

    def _counter_point_added(self) -> None:
        """A counter point was appended: settle the period that waited for it, then see whether the new
        last period must wait (it holds marks and, for the plain rule, the period before it holds no step
        boundary; whether its own marks make a boundary inside it is known only once the marks close to
        its end are, so any mark makes it wait)."""
        times = self.times
        shaped = self.shape is not None and self.shape.active
        if self._waiting:
            self._waiting = False
            if not (shaped and self._rebuild_shaped(len(times) - 3)):
                self._rebuild_step(len(times) - 3)
        if shaped:  # the period before the last one is final: evidence for where the power windows lie
            real = self._real_indices(3)
            if len(real) == 3:
                u0, u1 = times[real[0]], times[real[1]]
                self.shape.add_period(u0, u1, self.energies[real[1]] - self.energies[real[0]],
                                      self._boundaries_inside(u0, u1))
        n = len(times)
        if n >= 3 and self._marks_inside(times[-2], times[-1]) and (
                shaped or not self._boundaries_inside(times[-3], times[-2])):
            self._waiting = True

    def _real_indices(self, count: int) -> list[int]:
        """Indices of the last ``count`` points that are counter updates (not rebuilt steps), oldest first."""
        out: list[int] = []
        j = len(self.times) - 1
        while j >= 0 and len(out) < count:
            if self.update_early[j] != -math.inf:
                out.append(j)
            j -= 1
        return out[::-1]

    def _rebuild_shaped(self, i: int) -> bool:
        """Share out the counter period ``(times[i], times[i+1])``, which holds marks, by the power
        readings' windows (see "Counters with a power reading" in the module docstring): one segment
        between consecutive step boundaries (:func:`boundaries`), a point at each boundary inside the
        period. False when the readings cannot say (no window near, more segments than readings, no
        boundary inside the period): the neighbour rule then applies."""
        times, energies = self.times, self.energies
        if i < 0 or i + 2 >= len(times):
            return False
        before = [j for j in range(i - 1, -1, -1) if self.update_early[j] != -math.inf][:1]
        real = before + [i, i + 1, i + 2]
        lo, hi = times[real[0]], times[real[-1]]
        u0, u1 = times[i], times[i + 1]
        marks = self._boundaries_inside(lo, hi)
        inside = self._boundaries_inside(u0, u1)
        if not inside or not self.shape.placing:
            return False
        periods = [(times[a], times[b], energies[b] - energies[a]) for a, b in zip(real, real[1:])]
        if any(not b > a for a, b, _ in periods):
            return False
        windows = self.shape.windows_within(lo, hi)
        if not windows or len(marks) + 1 > len(periods) + len(windows):
            return False  # more segments than readings: they cannot tell the segments apart
        powers = segment_powers([lo, *marks, hi], periods, windows)
        cuts = [u0, *inside, u1]
        pieces = [powers[bisect.bisect_right(marks, (a + b) / 2.0)] * (b - a) for a, b in zip(cuts, cuts[1:])]
        estimate, exact = sum(pieces), energies[i + 1] - energies[i]
        if not estimate > 0.0 or not exact >= 0.0:
            return False
        scale = exact / estimate  # the counter's energy of the period is kept: its exact figure
        at, energy, end_J = i + 1, energies[i], energies[i + 1]  # (the points inserted shift index i + 1)
        for t, piece in zip(inside, pieces):
            energy = min(energy + piece * scale, end_J)
            self._insert_rebuilt_point(at, t, energy)
            at += 1
        return True

    def _insert_rebuilt_point(self, at: int, t: float, energy_J: float) -> None:
        """Insert a point the rule rebuilt (no reading behind it) at index ``at``: time ``t`` (s), cumulative
        ``energy_J`` (J); it never brackets the true energy, so its update window is unbounded."""
        self.times.insert(at, t)
        self.energies.insert(at, energy_J)
        self.update_early.insert(at, -math.inf)
        self.update_late.insert(at, math.inf)
        self._over.insert(at, 0.0)
        self._under.insert(at, 0.0)

    def _rebuild_step(self, i: int) -> None:
        """Rebuild the power step inside the period ``(times[i], times[i+1])`` (see the module docstring) when
        it holds a step boundary (:func:`boundaries`: the middle of a group of close marks) and its
        neighbours hold none. Its points go at the first and the last mark of the period's boundaries: the
        two marks of one boundary are then each exact for a step anywhere between them."""
        times, energies = self.times, self.energies
        if i < 1 or i + 2 >= len(times):
            return
        u0, u1, u2, um = times[i], times[i + 1], times[i + 2], times[i - 1]
        groups = [(first, last) for first, last in boundaries(self._breaks) if u0 < (first + last) / 2.0 < u1]
        if not groups or self._boundaries_inside(u1, u2) or self._boundaries_inside(um, u0):
            return
        if min(u1 - u0, u0 - um, u2 - u1) <= 0:
            return
        marks = [m for m in self._marks_inside(u0, u1) if groups[0][0] <= m <= groups[-1][1]]
        e0, e1 = energies[i], energies[i + 1]
        span = u1 - u0
        before = (e0 - energies[i - 1]) / (u0 - um)
        after = (energies[i + 2] - e1) / (u2 - u1)
        mean = (e1 - e0) / span
        if before == after or not min(before, after) <= mean <= max(before, after):
            return
        b1, bl = marks[0], marks[-1]
        from_before = e0 + before * (b1 - u0)
        from_after = e1 - after * (u1 - bl)
        if b1 == bl:
            x = b1 - u0
            figure = min(max(((span - x) * from_before + x * from_after) / span, e0), e1)
            new = [(b1, figure)]
        else:
            from_before, from_after = min(max(from_before, e0), e1), min(max(from_after, e0), e1)
            if from_before > from_after:
                return
            new = [(b1, from_before), (bl, from_after)]
        for at, (t, energy) in enumerate(new, start=i + 1):
            self._insert_rebuilt_point(at, t, energy)

    def _retime_first_point(self, u: float, early: float, late: float, period: float, moved: bool) -> None:
        """The counter's second point goes at ``u`` (its update within ``[early, late]``): put the first point
        at the update before it, one period earlier, where the value first read was reached (it sat at the
        read's time, so the first windows read up to a period's energy too much). Clamped to the span the
        first value was read in (the period before its read's end); left where it is when the second point
        is no move (an idle counter: nothing to place) or the spans do not meet (several updates between
        the two reads, each value as old as the other)."""
        first_read, self._first_read_s = self._first_read_s, None
        if not moved or len(self.times) != 1:
            return
        early0, late0 = max(early - period, first_read - period), min(late - period, first_read)
        if early0 > late0:
            return
        self.times[0] = min(max(u - period, early0), late0)
        self.update_early[0], self.update_late[0] = early0, late0

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
        early = max(lo, hi - period, prev)
        if not phase.pinned and hi - early < period:
            # one update somewhere in (early, hi]: its middle, as the pinned estimate starts out (the middle of
            # the arcs); at the read it sat half a read interval later than the pinned placements that follow
            return (early + hi) / 2.0, early, hi
        # an update off the schedule (late, or after a skipped one), or reads slower than the counter (each
        # value as old as the others): the time of the read that saw it
        return hi, early, hi

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
        """True when the energy at time ``t`` is final: a point at or after ``t`` exists and ``t`` is not
        inside a counter period waiting for the update after it (:attr:`last_time_s`)."""
        last = self.last_time_s
        return last is not None and last >= t

    def energy_at(self, t: float) -> float | None:
        """Cumulative energy (J) at time ``t`` by linear interpolation; None past the last point.

        Between :attr:`last_time_s` and the last point (a counter period waiting for the next update) the
        figure is provisional: read it only where :meth:`covers` says so.
        """
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
                return EdgeBound(energy, energy, energy, self._over[0], self._under[0])
            i = bisect.bisect_left(times, t)
            t0, t1 = times[i - 1], times[i]
            f = (t - t0) / (t1 - t0)
            over = self._over[i - 1] + (self._over[i] - self._over[i - 1]) * f
            under = self._under[i - 1] + (self._under[i] - self._under[i - 1]) * f
            return EdgeBound(energy, energy, energy, over, under)
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
        cut = min(cut, len(self.times) - max(keep_at_least, 4))  # a waiting period looks 1 point back
        if cut > 0:
            del self.times[:cut]
            del self.energies[:cut]
            del self.update_early[:cut]
            del self.update_late[:cut]
            del self._over[:cut]
            del self._under[:cut]


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
    swing = max(end.over_J - start.over_J, end.under_J - start.under_J)
    return spread + swing + start.resolution_J + end.resolution_J


def window_bound_J(series: SensorSeries, start_s: float, end_s: float) -> float:
    """Bound (J) on the attribution error of the energy of ``[start_s, end_s]`` as the series reports it.

    It covers how the energy is shared out in time between the sensor's readings (what happens between
    two samples, where a counter update falls); not the sensor's own accuracy (a power reading's error,
    NVML's ±5 %, an estimated sensor's model). ``inf`` when an edge lies outside the points (before the
    first one, or past the last one: an extrapolated edge), so record :meth:`SensorSeries.edge_bound`
    when each edge resolves.

    Power sensors (readings ``P_i`` at ``t_i``; each sample interval held at ``P_i`` until its change
    point (its first mark, or a point between it and mid-interval on a ramp) and at ``P_{i+1}`` from the
    last one, at their mean in between or, without a mark inside, over the whole interval: the
    trapezoid). The bound does NOT rely on the power changing at the marks; it
    assumes only that the power inside a sample interval stays between the readings at its two ends (at
    most one change, or a ramp, between two samples). Then, with ``ΔP_i = P_{i+1} − P_i``, the true
    power minus the figure's lies in ``[min(0, ΔP_i), max(0, ΔP_i)]`` where the figure holds ``P_i``, in
    ``[min(0, −ΔP_i), max(0, −ΔP_i)]`` where it holds ``P_{i+1}`` and within ``±|ΔP_i| / 2`` where it holds
    the mean. Summed over the window's overlap with each of these stretches (``O``: how much the true
    energy can exceed the figure, ``U``: fall short of it)::

        bound = max(O, U)

    Without marks this is the former trapezoid bound ``Σ_i L_i × |ΔP_i| / 2`` (``L_i``: the window's
    overlap with interval ``i``). At a window edge on a mark, the edge term is the part of the cut
    interval inside the window × ``|ΔP|``: twice the trapezoid's per second, because the rule bets on the
    mark and the bound covers a change anywhere in the interval (on a square wave changing at the marks
    the figure is exact and the bound is what it would be off by if the change were at a sample). Constant
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
    wide when the update times are known). The figure at an edge always lies in ``[L, H]`` (a rebuilt step
    inside a period stays between the values at its two ends), so this holds whatever the power did
    inside the period. With the estimate ``Ê = E(end) − E(start)``::

        bound = max(Ê − max(0, L(end) − H(start)),  H(end) − L(start) − Ê) + 2 × counter_resolution_J

    (``counter_resolution_J``: an optional sensor attribute, the counter's unit, e.g. 1 mJ for NVML; 0 if
    absent.)
    """
    if end_s < start_s:
        raise ValueError(f"window ends before it starts: [{start_s}, {end_s}]")
    return bound_between(series.edge_bound(start_s), series.edge_bound(end_s))
