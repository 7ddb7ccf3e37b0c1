"""The attribution rule of one sensor's series: counter updates at their update times, the boundary rule
(power changes at the marks), bounds, edge cases.

Every series is fed by hand on made-up times (no clock, no thread): a counter that integrates a known
power trace and updates on its own schedule (NVML's energy counter: every 0.1 s, unknown phase), and
power sensors sampled at known times.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics

import pytest

from lightning_energy.measure import series as series_module
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.series import SensorSeries

T0 = 1000.0  # where the sampler's clock happens to be
PERIOD = 0.1
PHASE = 0.037  # the card updates its counter at T0 + 0.037 + k * 0.1
STALE_REACH = 2 * PERIOD + 0.06  # a quiet counter's last point is at most this far behind the last read


class CounterSensor(Sensor):
    def __init__(self, period: float | None = PERIOD) -> None:
        super().__init__("gpu", "device")
        self.counter_update_period_s = period

    def energy_j(self) -> float:
        raise AssertionError("fed by hand")


class PowerSensor(Sensor):
    def __init__(self) -> None:
        super().__init__("cpu", "host")

    def power_w(self) -> float:
        raise AssertionError("fed by hand")


class Trace:
    """Piecewise-constant power ``[(t, watts), ...]`` (t relative to T0) and its exact integral."""

    def __init__(self, steps: list[tuple[float, float]]) -> None:
        self.starts = [T0 + t for t, _ in steps]
        self.watts = [w for _, w in steps]
        self.cumulative = [0.0]
        for i in range(1, len(steps)):
            self.cumulative.append(self.cumulative[-1] + (self.starts[i] - self.starts[i - 1]) * self.watts[i - 1])

    def power(self, t: float) -> float:
        return self.watts[max(bisect.bisect_right(self.starts, t) - 1, 0)]

    def energy(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t) - 1
        assert i >= 0, "before the trace"
        return self.cumulative[i] + (t - self.starts[i]) * self.watts[i]


class Counter:
    """An NVML-like counter: the exact integral of ``trace`` as of its latest update at or before ``t``."""

    def __init__(self, trace: Trace, updates: list[float]) -> None:
        self.trace = trace
        self.updates = sorted(updates)

    def read(self, t: float) -> float:
        i = bisect.bisect_right(self.updates, t) - 1
        return self.trace.energy(self.updates[i])


def schedule(period: float = PERIOD, phase: float = PHASE, until: float = 10.0) -> list[float]:
    return [T0 + phase + k * period for k in range(-3, int(until / period) + 3)]


def drifting_reads(n: int, start: float = 0.0005, interval: float = 0.0505) -> list[float]:
    """A sampler reading every 50.5 ms (50 ms plus a tick's cost): its phase sweeps the counter's period,
    1 ms per two reads."""
    return [T0 + start + interval * i for i in range(n)]


def feed(series: SensorSeries, counter: Counter, reads: list[float]) -> None:
    for t in reads:
        series.add_reading(t, counter.read(t))


def window_bound_J(series: SensorSeries, start_s: float, end_s: float) -> float:
    return series_module.window_bound_J(series, start_s, end_s)  # looked up here: one test fails at a time


def nearest(values: list[float], t: float) -> float:
    return min(values, key=lambda v: abs(v - t))


# ---------------------------------------------------------------------------------------- counter phase
def test_a_read_that_takes_milliseconds_places_updates_by_when_it_returned():
    """An H200's counter read takes 2.4 ms and may show an update that happened during the read. Told when
    each read returned, the series places the updates within 1 ms (timed only by when each read began, its
    estimate sat 2.0 ms early here)."""
    latency = 0.0024
    updates = schedule()
    counter = Counter(Trace([(-1.0, 100.0)]), updates)
    series = SensorSeries(CounterSensor())
    for t in drifting_reads(160):
        series.add_reading(t, counter.read(t + latency), read_end_s=t + latency)
    error = (series.phase.center_s - PHASE - T0 + PERIOD / 2) % PERIOD - PERIOD / 2
    assert series.phase.pinned and abs(error) < 0.001


def test_counter_updates_are_placed_at_their_update_times():
    trace = Trace([(-1.0, 100.0), (4.237, 300.0), (4.537, 50.0), (4.837, 200.0)])  # changes at updates
    updates = schedule()
    counter = Counter(trace, updates)
    series = SensorSeries(CounterSensor())
    reads = drifting_reads(120)
    feed(series, counter, reads)
    # windows aligned with the card's updates, across power changes of 250 W at 300 ms
    for a, b in [(4.237, 4.537), (4.537, 4.837), (4.137, 4.937)]:
        a, b = T0 + a, T0 + b
        exact = trace.energy(b) - trace.energy(a)
        figure = series.energy_at(b) - series.energy_at(a)
        # only the placement (≤ 0.5 ms) can move it: at most 0.5 ms × the power swing at each edge
        assert figure == pytest.approx(exact, abs=2 * 0.5e-3 * 250.0)
    placed = [t for t in series.times if t > T0 + 4.0]
    assert len(placed) >= 15
    for t in placed:
        assert abs(t - nearest(updates, t)) <= 0.5e-3
    # between two points the figure is the counter's own: exact over the updates they stand for
    i, j = series.times.index(placed[0]), series.times.index(placed[-1])
    start, end = nearest(updates, placed[0]), nearest(updates, placed[-1])
    assert series.energies[j] - series.energies[i] == pytest.approx(trace.energy(end) - trace.energy(start), rel=1e-12)
    phase = series.phase
    assert phase.pinned
    # the reads closest to the update on either side were 1 ms apart: the phase is known within 0.5 ms;
    # the interval it claims holds the true phase (it widens as time passes, to follow a drifting card)
    assert phase.center_s == pytest.approx(PHASE, abs=0.5e-3)
    assert abs(phase.center_s - PHASE) <= phase.half_width_s < 0.01
    for a, b in [(4.237, 4.537), (4.537, 4.837), (4.137, 4.937)]:
        a, b = T0 + a, T0 + b
        assert abs(series.energy_at(b) - series.energy_at(a) - (trace.energy(b) - trace.energy(a))) <= window_bound_J(
            series, a, b)


def test_phase_from_jittered_reads_matches_the_true_one_within_the_jitter():
    rng = random.Random(12)
    trace = Trace([(-1.0, 80.0), (2.0, 240.0), (2.5, 120.0)])
    updates = schedule()
    counter = Counter(trace, updates)
    # reads every 50 ms jittered by ±20 ms: some fall just before the update, some just after
    series = SensorSeries(CounterSensor())
    feed(series, counter, [T0 + 0.05 * i + rng.uniform(-0.02, 0.02) for i in range(100)])
    assert all(abs(t - nearest(updates, t)) <= 1e-3 for t in series.times[-10:])
    phase = series.phase
    assert phase.pinned and abs(phase.center_s - PHASE) <= 1e-3 and phase.half_width_s <= 2e-3 + phase.tolerance_s
    # reads jittered by 12 ms never come near the update: the phase is only known to lie between the
    # closest of them (38 ms apart), and the estimate says so
    series = SensorSeries(CounterSensor())
    feed(series, counter, [T0 + 0.05 * i + rng.uniform(0.0, 0.012) for i in range(100)])
    phase = series.phase
    assert phase.pinned and 0.015 <= phase.half_width_s <= 0.022
    assert abs(phase.center_s - PHASE) <= phase.half_width_s
    late_points = [t for t in series.times if t > T0 + 2.0]
    assert all(abs(t - nearest(updates, t)) <= phase.window_s() for t in late_points)


def test_an_update_is_placed_between_the_reads_around_it_until_the_phase_is_pinned_down():
    """Before the phase is pinned an update goes in the middle of the reads that bracket it, as the pinned
    estimate starts out (at the read that saw it, it sat half a read interval later than the placements
    after pinning: the first windows read that much too much); the first value, read at 0.010, goes at the
    update a period before (it dates from an update in the period before its read)."""
    trace = Trace([(-1.0, 100.0)])
    counter = Counter(trace, schedule())
    series = SensorSeries(CounterSensor())
    reads = [T0 + 0.01 + 0.05 * i for i in range(6)]  # updates at .037, .137, ...: seen at .060, .160, ...
    feed(series, counter, reads[:3])
    assert not series.phase.pinned
    middle = (reads[0] + reads[1]) / 2.0  # 0.035, the update at 0.037
    assert series.times == [pytest.approx(middle - PERIOD), pytest.approx(middle)]
    assert series.update_early[1] == reads[0] and series.update_late[1] == reads[1]
    assert not series.covers(reads[2])  # the counter has not moved since: 0.110 is not known yet
    assert series.energy_at(reads[2]) is None


def test_covers_only_once_an_update_after_the_time_is_placed():
    trace = Trace([(-1.0, 100.0)])
    updates = schedule()
    counter = Counter(trace, updates)
    series = SensorSeries(CounterSensor())
    reads = drifting_reads(100)
    feed(series, counter, reads[:-1])
    before = series.energies[-1]
    while counter.read(reads[-1]) == before:  # end on a read that sees the counter move
        reads[-1] += 0.01
    series.add_reading(reads[-1], counter.read(reads[-1]))
    last_update = series.times[-1]
    assert last_update < reads[-1]  # the move was seen after the card made it
    assert not series.covers(reads[-1])  # what happened since the update is in the next one
    assert series.energy_at(reads[-1]) is None
    assert series.covers(last_update) and not series.covers(last_update + 1e-6)
    assert series.energy_at(last_update) == series.energies[-1]
    assert series.phase.pinned and series.last_read_s == reads[-1]


def test_phase_survives_a_missed_and_a_late_update():
    trace = Trace([(-1.0, 100.0), (5.0, 250.0)])
    updates = schedule()
    skipped = T0 + PHASE + 5.0  # the card skips this update: the next one carries two periods
    late = T0 + PHASE + 5.5  # this one comes 30 ms late
    card = [u for u in updates if u != pytest.approx(skipped)]
    card = [u + 0.03 if u == pytest.approx(late) else u for u in card]
    counter = Counter(trace, card)
    series = SensorSeries(CounterSensor())
    feed(series, counter, drifting_reads(160))
    times, energies = series.times, series.energies
    # the skipped update looks like an idle period (a point on schedule, no energy), then the next one
    # lands on schedule with both periods' energy
    i = min(range(len(times)), key=lambda k: abs(times[k] - skipped))
    assert times[i] == pytest.approx(skipped, abs=0.5e-3) and energies[i] == energies[i - 1]
    assert times[i + 1] == pytest.approx(skipped + PERIOD, abs=0.5e-3)
    assert energies[i + 1] == pytest.approx(trace.energy(skipped + PERIOD))
    # the late one is off schedule: placed at the read that saw it; the next ones are on schedule again
    late_i = bisect.bisect_right(times, late)
    assert late + 0.03 <= times[late_i] <= late + 0.03 + 0.051
    assert energies[late_i] == pytest.approx(trace.energy(late + 0.03))
    for t in times[late_i + 1:]:
        assert abs(t - nearest(updates, t)) <= 0.5e-3
    assert all(b > a for a, b in zip(times, times[1:]))
    assert all(b >= a for a, b in zip(energies, energies[1:]))
    # long windows stay exact up to the placement; the bound holds across the odd updates
    a, b = T0 + 4.537, T0 + 6.037
    assert series.energy_at(b) - series.energy_at(a) == pytest.approx(trace.energy(b) - trace.energy(a), abs=0.5)
    for a, b in [(4.9, 5.3), (5.05, 5.15), (5.4, 5.7), (4.0, 7.0)]:
        a, b = T0 + a, T0 + b
        error = abs(series.energy_at(b) - series.energy_at(a) - (trace.energy(b) - trace.energy(a)))
        assert error <= window_bound_J(series, a, b) + 1e-9
    phase = series.phase
    assert phase.pinned and phase.center_s == pytest.approx(PHASE, abs=0.5e-3)


def test_phase_follows_a_schedule_that_moves_or_drifts():
    trace = Trace([(-1.0, 100.0)])
    # the card's schedule jumps by 40 ms at 5 s (say, a driver reset): the estimate starts afresh
    moved = [u for u in schedule(until=12.0) if u < T0 + 5.0]
    moved += [u for u in schedule(phase=PHASE + 0.04, until=12.0) if u > T0 + 5.0]
    series = SensorSeries(CounterSensor())
    feed(series, Counter(trace, moved), drifting_reads(230))
    late = [t for t in series.times if t > T0 + 9.0]
    assert late and all(abs(t - nearest(moved, t)) <= 1e-3 for t in late)
    assert series.phase.center_s == pytest.approx(PHASE + 0.04, abs=1e-3)
    # a card whose period is 200 ppm longer than the nominal 0.1 s: the phase drifts 20 us per update
    slow = [T0 + PHASE + k * 0.10002 for k in range(-3, 130)]
    series = SensorSeries(CounterSensor())
    feed(series, Counter(trace, slow), drifting_reads(230))
    assert series.phase.pinned
    late = [t for t in series.times if t > T0 + 9.0]
    assert late and all(abs(t - nearest(slow, t)) <= 2 * series.phase.tolerance_s for t in late)


def test_a_counter_that_stops_reads_zero_power_and_keeps_resolving():
    trace = Trace([(-1.0, 150.0), (5.037, 0.0)])  # the device goes idle at an update
    updates = schedule()
    counter = Counter(trace, updates)
    series = SensorSeries(CounterSensor())
    reads = drifting_reads(180)
    feed(series, counter, reads)
    idle = [t for t in series.times if t > T0 + 5.1]
    assert idle, "an idle counter still gets points"
    # on schedule (the update it skipped), spaced by at most two periods, never past the reads
    for t in idle:
        assert abs(t - nearest(updates, t)) <= 0.5e-3
    assert all(b - a <= 2 * PERIOD + 1e-9 for a, b in zip(idle, idle[1:]))
    assert series.times[-1] <= reads[-1] and series.covers(reads[-1] - STALE_REACH)
    a, b = T0 + 5.2, series.times[-1] - 0.05
    assert series.energy_at(b) - series.energy_at(a) == 0.0
    assert series.power_w == 0.0
    assert series.energy_at(T0 + 5.037) == pytest.approx(trace.energy(T0 + 5.037), abs=150.0 * 0.5e-3)
    assert window_bound_J(series, a, b) == 0.0  # a counter that did not move: no doubt at all
    assert series.phase.pinned


def test_reads_slower_than_the_counter_say_nothing_of_its_phase():
    trace = Trace([(-1.0, 100.0), (3.0, 200.0)])
    updates = schedule()
    series = SensorSeries(CounterSensor())
    reads = [T0 + 0.013 + 0.25 * i for i in range(30)]  # every 250 ms: several updates between two reads
    feed(series, Counter(trace, updates), reads)
    assert series.times == reads  # every read sees a move: each point at its read, as before
    assert not series.phase.pinned
    # the value read is that of the last update, within one period before the read
    assert all(t - PERIOD <= e <= t for e, t in zip(series.update_early[1:], series.times[1:]))
    for a, b in [(1.0, 2.0), (2.9, 3.2), (0.5, 6.5)]:
        a, b = T0 + a, T0 + b
        error = abs(series.energy_at(b) - series.energy_at(a) - (trace.energy(b) - trace.energy(a)))
        assert error <= window_bound_J(series, a, b) + 1e-9


def test_counter_checks_are_kept():
    series = SensorSeries(CounterSensor())
    series.add_reading(T0, 10.0)
    series.add_reading(T0 + 0.05, 12.0)
    with pytest.raises(ValueError, match="went backwards"):
        series.add_reading(T0 + 0.1, 11.0)
    with pytest.raises(ValueError, match="non-finite"):
        series.add_reading(T0 + 0.15, math.nan)
    power = SensorSeries(PowerSensor())
    with pytest.raises(ValueError, match="negative"):
        power.add_reading(T0, -1.0)


def test_a_counter_without_a_period_keeps_every_reading_at_its_time():
    series = SensorSeries(CounterSensor(period=None))
    for i, value in enumerate([5.0, 5.0, 7.0, 7.5]):
        series.add_reading(T0 + 0.05 * i, value)
    assert series.times == [T0 + 0.05 * i for i in range(4)]
    assert series.power_w == pytest.approx(10.0)
    assert series.phase is None
    assert series.trace_energy_J == 7.5
    # exact at every reading: an edge between two readings is bracketed by them
    # true energy at 0.075 in [5, 7], at 0.15 exactly 7.5: the window holds 0.5 to 2.5 J, the figure 1.5 J
    assert window_bound_J(series, T0 + 0.075, T0 + 0.15) == pytest.approx(1.0)


def test_trace_energy_is_the_counter_value_when_a_point_was_added():
    series = SensorSeries(CounterSensor())
    series.add_reading(T0, 1.0)
    assert series.trace_energy_J == 1.0
    series.add_reading(T0 + 0.05, 1.0)
    assert math.isnan(series.trace_energy_J)  # between updates: blank in the trace
    series.add_reading(T0 + 0.1, 3.0)
    assert series.trace_energy_J == 3.0


def test_trimming_keeps_the_points_and_their_spans_together():
    trace = Trace([(-1.0, 100.0)])
    series = SensorSeries(CounterSensor())
    feed(series, Counter(trace, schedule()), drifting_reads(120))
    n = len(series.times)
    cut_at = series.times[n // 2]
    series.trim_before(cut_at, keep_at_least=4)
    lists = (series.times, series.energies, series.update_early, series.update_late, series._over, series._under)
    assert len({len(values) for values in lists}) == 1 and series.times[1] == cut_at
    assert all(e <= t <= l for e, t, l in zip(series.update_early, series.times, series.update_late))


# ---------------------------------------------------------------------------------------- bounds
def test_power_bound_is_sampling_interval_times_swing_at_an_edge():
    series = SensorSeries(PowerSensor())
    trace = Trace([(-1.0, 50.0), (0.02, 150.0)])  # steps up 20 ms after a sample
    for t in (0.0, 0.05, 0.1, 0.15):
        series.add_reading(T0 + t, trace.power(T0 + t))
    a, b = T0 + 0.02, T0 + 0.15
    figure = series.energy_at(b) - series.energy_at(a)
    exact = trace.energy(b) - trace.energy(a)
    assert figure == pytest.approx(0.03 * 100.0 + 0.1 * 150.0)  # the trapezoid splits the step mid-interval
    assert exact == pytest.approx(0.13 * 150.0)
    # 30 ms of the cut interval in the window × 100 W swing / 2 = 1.5 J: here exactly the error
    assert window_bound_J(series, a, b) == pytest.approx(1.5)
    assert exact - figure == pytest.approx(1.5)
    assert window_bound_J(series, T0 + 0.05, T0 + 0.15) == 0.0  # constant power inside: no doubt
    assert window_bound_J(series, T0, T0 + 0.15) == pytest.approx(0.05 * 100.0 / 2)
    assert window_bound_J(series, T0 + 0.02, T0 + 0.04) == pytest.approx(0.02 * 100.0 / 2)  # inside one interval


def test_bound_is_infinite_where_the_series_does_not_reach():
    series = SensorSeries(PowerSensor())
    series.add_reading(T0, 10.0)
    series.add_reading(T0 + 0.05, 10.0)
    assert window_bound_J(series, T0, T0 + 0.06) == math.inf  # an extrapolated edge
    assert window_bound_J(series, T0 - 0.01, T0 + 0.05) == math.inf  # before the first sample
    with pytest.raises(ValueError):
        window_bound_J(series, T0 + 0.05, T0)


@pytest.mark.parametrize("step_s", [0.1, 0.3, 1.0])  # steps at least a sampling interval long
def test_bounds_contain_the_true_error_on_step_traces(step_s):
    rng = random.Random(int(step_s * 1000))
    steps = [(-1.0, 100.0)] + [(k * step_s, 150.0 if k % 2 else 50.0) for k in range(int(6.0 / step_s) + 1)]
    trace = Trace(steps)
    power = SensorSeries(PowerSensor())
    gpu = SensorSeries(CounterSensor())
    counter = Counter(trace, [u + rng.uniform(-0.001, 0.001) for u in schedule()])  # the card's own jitter
    t = T0
    while t < T0 + 6.5:
        power.add_reading(t, trace.power(t))
        gpu.add_reading(t, counter.read(t))
        t += 0.05 + rng.uniform(0.0, 0.002)
    marks = [T0 + k * step_s for k in range(1, int(5.0 / step_s))]
    for series in (power, gpu):
        for a, b in list(zip(marks, marks[1:])) + [(marks[0], marks[-1])]:
            error = abs(series.energy_at(b) - series.energy_at(a) - (trace.energy(b) - trace.energy(a)))
            bound = window_bound_J(series, a, b)
            assert error <= bound + 1e-9, (series.kind, a - T0, b - T0, error, bound)


def test_bounds_contain_the_true_error_on_a_ramp():
    def ramp(t):  # a triangle wave 50 -> 250 -> 50 W over 2 s, as a fine staircase
        x = ((t - T0) % 2.0) / 2.0
        return 50.0 + 400.0 * (x if x < 0.5 else 1.0 - x)

    trace = Trace([(-1.0, 50.0)] + [(k * 0.001, ramp(T0 + k * 0.001)) for k in range(6000)])
    series = SensorSeries(PowerSensor())
    t = T0
    while t < T0 + 6.0:
        series.add_reading(t, trace.power(t))
        t += 0.05
    for a in (0.013, 0.47, 0.99, 1.91):
        for length in (0.02, 0.1, 0.3, 2.5):
            lo, hi = T0 + a, T0 + a + length
            error = abs(series.energy_at(hi) - series.energy_at(lo) - (trace.energy(hi) - trace.energy(lo)))
            assert error <= window_bound_J(series, lo, hi) + 1e-9


def test_edge_bounds_recorded_at_resolution_give_the_window_bound():
    bound_between = series_module.bound_between
    trace = Trace([(-1.0, 100.0), (1.5, 200.0)])
    series = SensorSeries(CounterSensor())
    feed(series, Counter(trace, schedule()), drifting_reads(60))
    a, b = T0 + 1.23, T0 + 2.41
    start, end = series.edge_bound(a), series.edge_bound(b)
    assert start.low_J <= trace.energy(a) <= start.high_J and end.low_J <= trace.energy(b) <= end.high_J
    assert bound_between(start, end) == window_bound_J(series, a, b)
    assert bound_between(None, end) == math.inf


# ---------------------------------------------------------------------------------------- boundary rule
def feed_with_marks(series: SensorSeries, reads: list[float], value, marks: list[float]) -> dict[float, float]:
    """Feed ``value(t)`` at each read as the sampler does (the marks pending up to the read passed as
    breakpoints) and resolve marks as the Meter does (in order, once covered); returns the figure of each
    mark at its resolution, and checks it never changes afterwards."""
    pending, figures, upcoming = [], {}, sorted(marks)
    for t in reads:
        while upcoming and upcoming[0] <= t:
            pending.append(upcoming.pop(0))
        series.add_reading(t, value(t), breakpoints=list(pending))
        while pending and series.covers(pending[0]):
            m = pending.pop(0)
            figures[m] = series.energy_at(m)
    for m, figure in figures.items():
        assert series.energy_at(m) == figure, "a covered figure changed"
    return figures


def square_at_marks(marks: list[float], low: float = 50.0, high: float = 150.0) -> Trace:
    """Power alternating low/high, changing exactly at ``marks`` (relative to T0)."""
    return Trace([(-1.0, low)] + [(m, high if k % 2 == 0 else low) for k, m in enumerate(marks)])


def test_power_changes_at_marks_between_samples_give_exact_step_energies():
    rel_marks = [0.013 + 0.1 * k for k in range(19)]  # 100 ms steps, 13 ms after a sample
    trace = square_at_marks(rel_marks)
    marks = [T0 + m for m in rel_marks]
    reads = [T0 + 0.05 * k for k in range(42)]
    series = SensorSeries(PowerSensor())
    figures = feed_with_marks(series, reads, trace.power, marks)
    unaware = SensorSeries(PowerSensor())  # the same readings without the marks: the trapezoid
    for t in reads:
        unaware.add_reading(t, trace.power(t))
    assert len(figures) == len(marks)
    for a, b in zip(marks, marks[1:]):
        exact = trace.energy(b) - trace.energy(a)
        assert exact in (pytest.approx(15.0), pytest.approx(5.0))
        assert figures[b] - figures[a] == pytest.approx(exact, rel=1e-12, abs=1e-12)
        # the trapezoid (no marks: the change mid-interval, 12 ms off) is 2.5 J off every step
        assert abs(unaware.energy_at(b) - unaware.energy_at(a) - exact) == pytest.approx(2.5, rel=1e-9)
    # at the samples the cumulative energy is exact too (so are windows between any marks and samples)
    for t in reads[1:]:
        assert series.energy_at(t) - series.energy_at(reads[0]) == pytest.approx(
            trace.energy(t) - trace.energy(reads[0]), rel=1e-12)


def test_power_with_several_marks_in_one_interval_holds_each_reading_up_to_the_nearest_mark():
    series = SensorSeries(PowerSensor())
    series.add_reading(T0, 50.0)
    series.add_reading(T0 + 0.05, 150.0, breakpoints=[T0 + 0.03, T0 + 0.01, T0 - 0.2, T0 + 0.07])
    assert series.times == pytest.approx([T0, T0 + 0.01, T0 + 0.03, T0 + 0.05])
    # 50 W until the first mark, the mean (100 W) between the marks, 150 W from the last one on
    assert series.energies == pytest.approx([0.0, 0.5, 2.5, 5.5], rel=1e-12)
    assert series.power_w == 150.0 and series.trace_energy_J == pytest.approx(5.5)


def test_power_on_a_ramp_keeps_the_trapezoid_exact_at_the_samples():
    def power(t):  # flat 50 W, then a ramp of 100 W/s from 0.2 s, marks every 100 ms at +13 ms
        return 50.0 + 100.0 * max(0.0, t - T0 - 0.2)

    def energy(t):
        x = max(0.0, t - T0 - 0.2)
        return 50.0 * (t - T0) + 50.0 * x * x

    reads = [T0 + 0.05 * k for k in range(30)]
    marks = [T0 + 0.013 + 0.1 * k for k in range(14)]
    series = SensorSeries(PowerSensor())
    feed_with_marks(series, reads, power, marks)

    def exact(a, b):
        return energy(b) - energy(a)

    # the ramp's first interval (0.20-0.25, flat before it) looks like a step: its change goes to the mark
    # at 0.213, which costs k Δt (b - mid) = 100 × 0.05 × (0.213 - 0.225) = -0.06 J (at most k Δt² / 2)
    first = series.energy_at(reads[5]) - series.energy_at(reads[4])
    assert first - exact(reads[4], reads[5]) == pytest.approx(5.0 * (0.225 - 0.213), rel=1e-9)
    # from then on the interval before rose as fast: the trapezoid, exact at the samples
    for a, b in zip(reads[5:], reads[6:]):
        assert series.energy_at(b) - series.energy_at(a) == pytest.approx(exact(a, b), rel=1e-12)
    for m in marks[3:]:  # between samples: the trapezoid's k Δt² / 8 at most
        i = bisect.bisect_left(reads, m)
        error = series.energy_at(m) - series.energy_at(reads[i - 1]) - exact(reads[i - 1], m)
        assert abs(error) <= 100.0 * 0.05 ** 2 / 8 + 1e-9


@pytest.mark.parametrize("sensor", ["power", "exact counter", "nvml counter"])
def test_constant_power_stays_exact_with_marks(sensor):
    trace = Trace([(-1.0, 120.0)])
    if sensor == "power":
        series, value = SensorSeries(PowerSensor()), trace.power
    else:
        series = SensorSeries(CounterSensor(period=None if sensor == "exact counter" else PERIOD))
        value = Counter(trace, schedule()).read if sensor == "nvml counter" else trace.energy
    reads = drifting_reads(200)
    marks = [T0 + 0.3 + 0.137 * k for k in range(68)]
    figures = feed_with_marks(series, reads, value, marks)
    if sensor == "nvml counter":  # once the phase is pinned (4 s): the placed update times, 0.5 ms each
        marks, tolerance = [m for m in marks if m > T0 + 4.0], 2 * 120.0 * 0.5e-3
    else:
        tolerance = 1e-9
    for a, b in zip(marks, marks[1:]):
        assert figures[b] - figures[a] == pytest.approx(120.0 * (b - a), abs=tolerance)
    if sensor == "power":
        assert window_bound_J(series, marks[0], marks[-1]) == 0.0
        assert len(series.times) == len(reads)  # no change, no extra point


def test_counter_exact_at_reads_rebuilds_a_step_at_its_mark():
    rel_marks = [0.113 + 0.3 * k for k in range(19)]  # 300 ms steps, reads every 50 ms
    trace = square_at_marks(rel_marks)
    marks = [T0 + m for m in rel_marks]
    reads = [T0 + 0.05 * k for k in range(120)]
    series = SensorSeries(CounterSensor(period=None))  # RAPL-like: exact at every read
    figures = feed_with_marks(series, reads, trace.energy, marks)
    linear = SensorSeries(CounterSensor(period=None))
    feed(linear, Counter(trace, reads), reads)
    for a, b in zip(marks, marks[1:]):
        exact = trace.energy(b) - trace.energy(a)
        assert figures[b] - figures[a] == pytest.approx(exact, rel=1e-12)
        # linear between the reads: each change spread over its 50 ms, 2 × 100 W × 13 ms × 37/50 off
        assert abs(linear.energy_at(b) - linear.energy_at(a) - exact) == pytest.approx(2 * 100.0 * 0.013 * 0.037 / 0.05)


def test_a_counter_mark_resolves_one_point_later_and_its_figure_is_final():
    trace = square_at_marks([0.313])
    series = SensorSeries(CounterSensor(period=None))
    mark = T0 + 0.313
    reads = [T0 + 0.05 * k for k in range(10)]
    for t in reads[:7]:  # up to 0.30: the mark is not reached
        series.add_reading(t, trace.energy(t), breakpoints=[mark] if mark <= t else [])
    series.add_reading(reads[7], trace.energy(reads[7]), breakpoints=[mark])  # 0.35: the period holding it
    assert series.times[-1] > mark and not series.covers(mark)  # waits for the period after
    assert series.last_time_s == reads[6]
    series.add_reading(reads[8], trace.energy(reads[8]), breakpoints=[mark])  # 0.40: settled
    assert series.covers(mark) and series.last_time_s == reads[8]
    assert series.energy_at(mark) == pytest.approx(trace.energy(mark) - trace.energy(reads[0]) + series.energies[0])
    assert series.update_early[series.times.index(mark)] == -math.inf  # a rebuilt point is no reading
    # a sensor that fails while a period waits keeps that period linear, final
    stuck = SensorSeries(CounterSensor(period=None))
    for t in reads[:8]:
        stuck.add_reading(t, trace.energy(t), breakpoints=[mark] if mark <= t else [])
    assert not stuck.covers(mark)
    stuck.failure = "gone"
    assert stuck.covers(mark) and stuck.last_time_s == reads[7]


def test_nvml_like_counter_with_marks_attributes_steps_within_the_update_placement():
    rel_marks = [0.513 + 0.3 * k for k in range(28)]
    trace = square_at_marks(rel_marks)
    marks = [T0 + m for m in rel_marks]
    counter = Counter(trace, schedule())
    reads = drifting_reads(190)
    series = SensorSeries(CounterSensor())
    figures = feed_with_marks(series, reads, counter.read, marks)
    linear = SensorSeries(CounterSensor())
    feed(linear, counter, reads)
    errors, linear_errors = [], []
    marks = [m for m in marks if m > T0 + 4.0]  # once the phase is pinned down
    for a, b in zip(marks, marks[1:]):
        exact = trace.energy(b) - trace.energy(a)
        errors.append(abs(figures[b] - figures[a] - exact))
        linear_errors.append(abs(linear.energy_at(b) - linear.energy_at(a) - exact))
        assert errors[-1] <= window_bound_J(series, a, b) + 1e-9
    # each edge off by at most the update placement (~0.5 ms) × the 100 W swing, not by the period's spread
    assert max(errors) <= 2 * 100.0 * 1e-3
    assert sorted(linear_errors)[len(linear_errors) // 2] >= 2.0  # linear over the period: J per step


def test_power_bound_with_a_mark_covers_a_change_anywhere_in_the_interval():
    mark = T0 + 0.02
    worst = 0.0
    for true_change in [0.0005 + 0.001 * k for k in range(50)]:  # the power really steps anywhere in 0-50 ms
        trace = Trace([(-1.0, 50.0), (true_change, 150.0)])
        series = SensorSeries(PowerSensor())
        for t in (0.0, 0.05, 0.1, 0.15):
            series.add_reading(T0 + t, trace.power(T0 + t), breakpoints=[mark])
        figure = series.energy_at(T0 + 0.15) - series.energy_at(mark)
        assert figure == pytest.approx(0.13 * 150.0)  # the figure bets on the mark
        error = abs(figure - (trace.energy(T0 + 0.15) - trace.energy(mark)))
        # the 30 ms of the cut interval inside the window × the 100 W swing
        assert window_bound_J(series, mark, T0 + 0.15) == pytest.approx(3.0)
        assert error <= window_bound_J(series, mark, T0 + 0.15) + 1e-9
        assert window_bound_J(series, T0, mark) == pytest.approx(2.0)  # the 20 ms before it
        worst = max(worst, error)
    assert worst == pytest.approx(3.0, abs=0.06)  # the bound is what a change at the far sample costs


@pytest.mark.parametrize("step_s", [0.1, 0.3, 1.0])
def test_bounds_contain_the_true_error_with_marks(step_s):
    rng = random.Random(int(step_s * 1000) + 1)
    rel_marks = [0.0137 + k * step_s for k in range(int(6.0 / step_s) + 1)]
    trace = square_at_marks(rel_marks)
    marks = [T0 + m for m in rel_marks]
    counter = Counter(trace, [u + rng.uniform(-0.001, 0.001) for u in schedule()])
    reads, t = [], T0
    while t < T0 + 6.5:
        reads.append(t)
        t += 0.05 + rng.uniform(0.0, 0.002)
    for series, value in ((SensorSeries(PowerSensor()), trace.power), (SensorSeries(CounterSensor()), counter.read),
                          (SensorSeries(CounterSensor(period=None)), trace.energy)):
        bounds = {}
        pending, upcoming = [], list(marks)
        for t in reads:  # the Meter records each edge's bound when the mark resolves
            while upcoming and upcoming[0] <= t:
                pending.append(upcoming.pop(0))
            series.add_reading(t, value(t), breakpoints=list(pending))
            while pending and series.covers(pending[0]):
                m = pending.pop(0)
                bounds[m] = (series.energy_at(m), series.edge_bound(m))
        edges = [m for m in marks if m in bounds and m > T0 + 1.0]
        for a, b in list(zip(edges, edges[1:])) + [(edges[0], edges[-1])]:
            error = abs(bounds[b][0] - bounds[a][0] - (trace.energy(b) - trace.energy(a)))
            bound = series_module.bound_between(bounds[a][1], bounds[b][1])
            assert error <= bound + 1e-9, (series.kind, series.sensor.counter_update_period_s, a - T0, error, bound)


def test_steps_plus_gaps_equal_the_epoch_through_the_sampler(manual_sampler, clock):
    """The sampler passes its meters' pending marks: a power that changes at the step boundaries, between
    samples, gives exact step energies (power sensor, and a counter exact at its reads whose neighbouring
    read intervals hold no boundary), and steps + gaps add up to the epoch."""
    from lightning_energy.measure.meter import Meter, measure
    from lightning_energy.simulate.simulated_sensor import SimulatedSensor

    # relative to the sensors' origin (the clock at acquire): gaps of 163-177 ms at 40 W, steps at 200 / 90 W
    boundaries, trace, t = [], [(0.0, 40.0)], 0.117
    for i in range(12):
        boundaries += [t, t + 0.2 + 0.1 * (i % 3)]  # step start, step end
        trace += [(t, 200.0 if i % 2 == 0 else 90.0), (boundaries[-1], 40.0)]
        t = boundaries[-1] + 0.163 + 0.014 * (i % 2)  # each gap holds samples: its 40 W is seen
    sensors = [SimulatedSensor("cpu", trace, scope="host", clock=clock),
               SimulatedSensor("rapl", trace, kind="energy", clock=clock)]
    names = manual_sampler.acquire("test", sensors, interval_s=0.05, start_thread=False)
    meter = Meter(manual_sampler, names)
    meter.clock.record = clock
    manual_sampler.add_meter(meter)
    origin = clock()
    epoch_start = meter.mark()
    marks = []
    for b in boundaries + [t]:
        while clock() + 0.05 < origin + b:  # sample every 50 ms up to the boundary, then mark at it
            clock.advance(0.05)
            manual_sampler.sample_once()
        clock.t = origin + b
        marks.append(meter.mark())
    epoch_end = marks.pop()
    for _ in range(6):
        clock.advance(0.05)
        manual_sampler.sample_once()
    assert all(m.resolved and not m.extrapolated for m in [epoch_start, *marks, epoch_end])
    steps = list(zip(marks[0::2], marks[1::2]))
    gaps = list(zip([epoch_start, *marks[1::2]], [*marks[0::2], epoch_end]))
    epoch = measure(epoch_start, epoch_end)
    for name, sensor in zip(names, sensors):
        for a, b in steps:
            exact = sensor.energy_at(b.t - origin) - sensor.energy_at(a.t - origin)
            assert measure(a, b).energy_J[name] == pytest.approx(exact, rel=1e-9), name
        total = sum(measure(a, b).energy_J[name] for a, b in steps + gaps)
        assert total == pytest.approx(epoch.energy_J[name], rel=1e-12)
        assert epoch.energy_J[name] == pytest.approx(
            sensor.energy_at(epoch_end.t - origin) - sensor.energy_at(epoch_start.t - origin), rel=1e-9), name


@pytest.mark.parametrize("after_w", [50.0, 0.0])  # 0 W: the counter stops, the period after comes stale
def test_a_counter_mark_in_a_rebuilt_period_resolves_within_the_sampler_wait(manual_sampler, clock, after_w):
    from lightning_energy.measure.meter import Meter
    from lightning_energy.simulate.simulated_sensor import SimulatedSensor

    change = 5.0137  # s after the sensor's origin; its counter updates every 0.1 s from the origin
    sensor = SimulatedSensor("gpu", [(0.0, 150.0), (change, after_w)], kind="energy", counter_update_period_s=PERIOD,
                             clock=clock)
    names = manual_sampler.acquire("test", [sensor], interval_s=0.05, start_thread=False)
    meter = Meter(manual_sampler, names)
    meter.clock.record = clock
    manual_sampler.add_meter(meter)
    origin = clock()
    before, settled = meter.mark(), None
    while clock() + 0.0505 < origin + change:  # 50 ms ticks running 0.5 ms late: the phase gets pinned
        clock.advance(0.0505)
        manual_sampler.sample_once()
        if settled is None and clock() > origin + change - 0.3:
            settled = meter.mark()  # the first point is placed within half a read interval: start later
    clock.t = origin + change
    mark = meter.mark()
    waited = None
    for _ in range(20):
        clock.advance(0.0505)
        manual_sampler.sample_once()
        if mark.resolved and waited is None:
            waited = clock() - mark.t
    series = manual_sampler.series["gpu"]
    assert series.phase.pinned and mark.resolved and not mark.extrapolated
    # one counter period later than at the first update after the mark, within the sampler's wait
    assert PERIOD < waited <= manual_sampler.resolution_timeout_s()
    from lightning_energy.measure.meter import measure

    for start in (before, settled):
        window = measure(start, mark)
        error = abs(window.energy_J["gpu"] - (sensor.energy_at(change) - sensor.energy_at(start.t - origin)))
        assert error <= window.bound_J
    # off by the update placement only (the phase is known within ±4.4 ms here)
    assert error <= 150.0 * series.phase.half_width_s


# ------------------------------------------------------------ a counter shaped by its power readings
class ShapedCounterSensor(CounterSensor):
    """NVML on A100/H100/H200: the counter, and the instant power: the mean over 25 ms ending ``lag`` before
    each refresh of the reading (every period, on its own schedule)."""

    shape_window_s = 0.025
    shape_power_field = "power_W"

    def __init__(self, lag: float = 0.0) -> None:
        super().__init__()
        self.shape_lag_s = lag


def idle_then_square(marks: list[float], rng: random.Random) -> Trace:
    """An idle card's power wandering by a watt every 30 ms (so its power reading changes at every refresh,
    as a real one does), then :func:`square_at_marks`."""
    wander = [(-1.0 + 0.03 * k, 50.0 + rng.uniform(-1.0, 1.0)) for k in range(int((marks[0] + 1.0) / 0.03))]
    return Trace(wander + [(m, 150.0 if k % 2 == 0 else 50.0) for k, m in enumerate(marks)])


def feed_shaped(series: SensorSeries, trace: Trace, counter: Counter, reads: list[float], marks: list[float],
                resolved: dict[float, float], offset: float = 0.0, lag: float = 0.0) -> None:
    """Feed as the sampler does (pending marks up to each read, the power reading with every read) and
    record each mark's figure when it resolves, as the Meter does. The power reading refreshes ``offset``
    after each counter update and holds the mean over the 25 ms ending ``lag`` before its refresh (an H200:
    55 and 11 ms; 0 and 0 would be a reading refreshed with the counter over the 25 ms before it)."""
    pending, upcoming = [], sorted(marks)
    window = ShapedCounterSensor.shape_window_s
    refreshes = [u + offset for u in counter.updates]
    for t in reads:
        while upcoming and upcoming[0] <= t:
            pending.append(upcoming.pop(0))
        end = refreshes[bisect.bisect_right(refreshes, t) - 1] - lag
        series.add_reading(t, counter.read(t), breakpoints=list(pending),
                           shape_w=(trace.energy(end) - trace.energy(end - window)) / window)
        while pending and series.covers(pending[0]):
            m = pending.pop(0)
            resolved[m] = series.energy_at(m)


def shaped_run(rel_marks: list[float], rng: random.Random, offset: float, lag: float):
    """Idle, then 150/50 W in turn from each of ``rel_marks``; a counter updating every 100 ms (±0.5 ms); reads
    every 50 ms plus 0-2 ms (a tick's cost, wake-up lateness) for 6.5 s, fed by :func:`feed_shaped`. Returns
    the series, the trace, the counter's updates, the marks and their figures."""
    trace = idle_then_square(rel_marks, rng)
    updates = [u + rng.uniform(-0.0005, 0.0005) for u in schedule()]
    marks = [T0 + m for m in rel_marks]
    resolved: dict[float, float] = {}
    series = SensorSeries(ShapedCounterSensor(lag))
    reads, t = [], T0
    while t < T0 + 6.5:
        reads.append(t)
        t += 0.05 + rng.uniform(0.0, 0.002)
    feed_shaped(series, trace, Counter(trace, updates), reads, marks, resolved, offset, lag)
    return series, trace, updates, marks, resolved


def step_errors(trace: Trace, marks: list[float], resolved: dict[float, float]) -> list[float]:
    """Relative error of each step between consecutive resolved marks."""
    errors = []
    for a, b in zip(marks, marks[1:]):
        if a in resolved and b in resolved:
            exact = trace.energy(b) - trace.energy(a)
            errors.append(abs(resolved[b] - resolved[a] - exact) / exact)
    return errors


@pytest.mark.parametrize("offset, lag", [(0.0, 0.0), (0.055, 0.011)], ids=["with the counter", "H200"])
@pytest.mark.parametrize("step_s", [0.1, 0.15, 0.3])
def test_a_counter_shaped_by_its_power_windows_attributes_steps_of_one_update_period(step_s, offset, lag):
    """100 ms steps on a 100 ms counter: every period holds a boundary, so the counter alone cannot say
    where in it the work changed (the neighbour rule leaves such periods linear: ~60 % off per step). The
    power reading (the mean of 25 ms, refreshed every 100 ms on its own schedule: on an H200 55 ms after
    the counter, ending 11 ms before the refresh) says which power held on which side; each period's exact
    energy is shared out by it, so the counter's figures at its updates stay exact. Placing the H200's
    windows at the counter's updates instead (the rule before) put the steps 111 % off (median)."""
    rel_marks = [3.0213 + k * step_s for k in range(int(3.0 / step_s))]  # the phases are pinned to ~3 ms by 3 s
    series, trace, updates, marks, resolved = shaped_run(rel_marks, random.Random(7), offset, lag)
    assert series.phase.pinned and series.shape_phase.pinned and all(m in resolved for m in marks)
    assert (series.shape_phase.center_s - updates[0] - offset + 0.05) % 0.1 - 0.05 == pytest.approx(0.0, abs=0.004)
    errors = step_errors(trace, marks, resolved)
    # within the update placement: ±3 ms of a 100 W swing at each edge of a 5-15 J step
    assert statistics.median(errors) < 0.01 and max(errors) < 0.05, (statistics.median(errors), max(errors))
    # energy-conserving: every counter update keeps its value (the points added at the marks lie between)
    real = [i for i, early in enumerate(series.update_early) if early != -math.inf][1:]
    assert len(real) < len(series.times) - len(rel_marks) // 2
    for i in real:
        assert series.energies[i] == pytest.approx(trace.energy(nearest(updates, series.times[i])), abs=1e-9)
    assert all(b >= a for a, b in zip(series.energies, series.energies[1:]))


@pytest.mark.parametrize("offset, lag", [(0.0, 0.0), (0.055, 0.011)], ids=["with the counter", "H200"])
def test_a_period_holding_two_marks_shares_its_energy_among_three_segments(offset, lag):
    """Steps of 70-130 ms: some counter periods hold two marks (a whole step under 100 ms and the edges of
    its neighbours). Each inserted point must take its own share of the period's energy; the rule
    before gave the second point the first one's figure (its clamp read a shifted index), so one step read
    0 J and the next took its energy (a 0 %/285 % pair in every such period)."""
    rng = random.Random(11)
    rel_marks, t = [], 3.0213
    while t < 6.0:
        rel_marks.append(t)
        t += rng.uniform(0.07, 0.13)
    series, trace, updates, marks, resolved = shaped_run(rel_marks, rng, offset, lag)
    periods_with_two = sum(sum(u < m < u + PERIOD for m in marks) == 2 for u in updates)
    assert periods_with_two >= 3
    errors = step_errors(trace, marks[5:], resolved)
    assert len(errors) > 20 and statistics.median(errors) < 0.01 and max(errors) < 0.2, (
        statistics.median(errors), max(errors))


def test_a_power_reading_that_keeps_its_value_across_a_scheduled_refresh_still_places_its_window():
    """Once the reading's schedule is pinned, a refresh that keeps the value (an idle card's power held to the
    mW, or two windows inside one step) is still a window, one per period. Without it a stretch of short steps
    lost its windows and fell back to the neighbour rule (a 50 W step read 100 % off in
    ``benchmarks/shaping_phases.py``)."""
    rel_marks = [3.0213 + 0.3 * k for k in range(10)]  # 300 ms steps: consecutive windows in one step read alike
    series, trace, updates, marks, resolved = shaped_run(rel_marks, random.Random(5), 0.055, 0.011)
    ends = [end for _, end, _, in series._windows]  # the latest SHAPE_WINDOWS_KEPT, in the flat last second
    assert len(ends) == series_module.SHAPE_WINDOWS_KEPT
    assert all(b - a == pytest.approx(PERIOD, abs=0.01) for a, b in zip(ends, ends[1:]))
    assert (ends[-1] + 0.011 - updates[0] - 0.055 + 0.05) % PERIOD - 0.05 == pytest.approx(0.0, abs=0.01)


def test_a_shaped_counter_with_more_segments_than_readings_stays_linear():
    """20 ms steps: five segments per period and one power window: nothing tells them apart, so the
    period is shared out linearly (as without the power readings), never by a guess."""
    rel_marks = [2.0213 + k * 0.02 for k in range(150)]
    trace = square_at_marks(rel_marks)
    counter = Counter(trace, schedule())
    reads = drifting_reads(120)
    shaped, plain = SensorSeries(ShapedCounterSensor()), SensorSeries(CounterSensor())
    marks = [T0 + m for m in rel_marks]
    got: dict[float, float] = {}
    feed_shaped(shaped, trace, counter, reads, marks, got)
    pending, upcoming = [], list(marks)
    for t in reads:
        while upcoming and upcoming[0] <= t:
            pending.append(upcoming.pop(0))
        plain.add_reading(t, counter.read(t), breakpoints=list(pending))
    for m in marks[:100]:
        assert got[m] == pytest.approx(plain.energy_at(m), abs=1e-9)


def test_power_bounds_hold_for_steps_shorter_than_the_sampling_interval():
    """20 ms steps alternating 50/150 W read every ~50 ms: two equal readings (50 W, 50 W) may enclose
    unseen 150 W steps. The figure cannot know (sampling), but its bound must say so: the stretch between
    the first and the last mark of such an interval is bounded by the range of powers read so far."""
    rng = random.Random(5)
    rel_marks = [0.0137 + k * 0.02 for k in range(300)]
    trace = square_at_marks(rel_marks)
    marks = [T0 + m for m in rel_marks]
    series = SensorSeries(PowerSensor())
    resolved, pending, upcoming, t = {}, [], list(marks), T0
    while t < T0 + 6.2:
        while upcoming and upcoming[0] <= t:
            pending.append(upcoming.pop(0))
        series.add_reading(t, trace.power(t), breakpoints=list(pending))
        while pending and series.covers(pending[0]):
            m = pending.pop(0)
            resolved[m] = (series.energy_at(m), series.edge_bound(m))
        t += 0.05 + rng.uniform(0.0, 0.002)
    edges = [m for m in marks if m > T0 + 0.5 and m in resolved]
    missed = 0
    for a, b in list(zip(edges, edges[1:])) + [(edges[0], edges[-1])]:
        error = abs(resolved[b][0] - resolved[a][0] - (trace.energy(b) - trace.energy(a)))
        missed += error > series_module.bound_between(resolved[a][1], resolved[b][1]) + 1e-9
    assert missed == 0
