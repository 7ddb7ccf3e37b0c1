"""The series rules as a real fit feeds them: two marks at every step boundary, a counter's first reading,
and a power reading that does not follow the NVML model.

- Lightning places two marks at each step boundary (a step's end and the next step's start, 0.5-3 ms apart).
  They make one boundary for the rules (one change of power, at their middle): the rules that gave up on
  "more segments than readings" or on "a neighbour holds marks" must keep their one-mark accuracy.
- A counter's first reading holds the value of an update up to one period older: its point goes at that
  update once the next one is placed, so the first window after acquisition is not a period's energy high.
- A counter shaped by a power reading whose refresh schedule is not the counter's (every 150 ms, at random)
  falls back to the plain counter rule and says so (``SensorSeries.shaping``).

Fed by hand on made-up times, as in ``tests/test_series.py`` (no clock, no thread).
"""

from __future__ import annotations

import random
import statistics

import pytest
from test_series import (
    PERIOD,
    T0,
    Counter,
    CounterSensor,
    PowerSensor,
    ShapedCounterSensor,
    Trace,
    drifting_reads,
    feed_shaped,
    feed_with_marks,
    idle_then_square,
    schedule,
    square_at_marks,
)

from lightning_energy.measure import series as series_module
from lightning_energy.measure.series import SensorSeries

GAP_S = (0.0005, 0.003)  # Lightning: a step's end and the next step's start


def with_second_marks(changes: list[float], rng: random.Random) -> tuple[list[float], list[tuple[float, float]]]:
    """The marks of steps whose power changes at ``changes`` (absolute s) as a fit places them: the step's
    end at the change, the next step's start 0.5-3 ms later. Returns all marks and each step's
    (start mark, end mark)."""
    starts = [c + rng.uniform(*GAP_S) for c in changes]
    return sorted(changes + starts), list(zip(starts, changes[1:]))


def step_errors_between(trace: Trace, steps: list[tuple[float, float]], figures: dict[float, float]) -> list[float]:
    return [abs(figures[b] - figures[a] - (trace.energy(b) - trace.energy(a))) / (trace.energy(b) - trace.energy(a))
            for a, b in steps if a in figures and b in figures]


def gap_share(trace: Trace, steps: list[tuple[float, float]], changes: list[float]) -> list[float]:
    """Per step, what putting each change in the middle of its gap costs at most (a share of the step's
    energy): half of each of the two gaps (before the step's start, after its end) times the swing."""
    out = []
    for a, b in steps:
        before = max(c for c in changes if c <= a)
        after = min((s for s, _ in steps if s > b), default=b)  # the next step's start
        swing = abs(trace.power(a) - trace.power(before - 1e-9))
        out.append(swing * ((a - before) + (after - b)) / 2.0 / (trace.energy(b) - trace.energy(a)))
    return out


def test_marks_closer_than_the_cluster_gap_make_one_boundary():
    boundaries = series_module.boundaries
    assert boundaries([]) == []
    assert boundaries([T0 + 0.1, T0, T0 + 0.002, T0 + 0.1025, T0 + 0.2]) == [
        (T0, T0 + 0.002), (T0 + 0.1, T0 + 0.1025), (T0 + 0.2, T0 + 0.2)]
    # a run of marks each a few ms apart is cut every MARK_CLUSTER_S: no boundary spans more than that
    dense = [T0 + 0.002 * k for k in range(10)]
    assert all(last - first <= series_module.MARK_CLUSTER_S for first, last in boundaries(dense))
    assert len(boundaries(dense)) >= 3


# ------------------------------------------------------------------ counter shaped by its power windows
@pytest.mark.parametrize("offset, lag", [(0.0, 0.0), (0.055, 0.011)], ids=["with the counter", "H200"])
@pytest.mark.parametrize("step_s", [0.1, 0.15, 0.3])
def test_a_shaped_counter_keeps_its_accuracy_with_two_marks_per_boundary(step_s, offset, lag):
    """``test_a_counter_shaped_by_its_power_windows_attributes_steps_of_one_update_period`` with the second
    mark: each mark counted as a segment left more segments than readings for 100 and 150 ms steps, so the
    periods stayed linear (about 30-60 % off per step). One boundary per pair keeps the one-mark accuracy,
    up to half the gap's energy at a step's start (the change is put in the middle of the gap)."""
    rng = random.Random(7)
    changes = [T0 + 3.0213 + k * step_s for k in range(int(3.0 / step_s))]
    marks, steps = with_second_marks(changes, rng)
    trace = idle_then_square([c - T0 for c in changes], rng)
    counter = Counter(trace, [u + rng.uniform(-0.0005, 0.0005) for u in schedule()])
    reads, t = [], T0
    while t < T0 + 6.5:
        reads.append(t)
        t += 0.05 + rng.uniform(0.0, 0.002)
    series, figures = SensorSeries(ShapedCounterSensor(lag)), {}
    feed_shaped(series, trace, counter, reads, marks, figures, offset, lag)
    assert all(m in figures for m in marks)
    errors = [e - g for e, g in zip(step_errors_between(trace, steps, figures), gap_share(trace, steps, changes))]
    assert statistics.median(errors) < 0.01 and max(errors) < 0.05, (statistics.median(errors), max(errors))
    assert all(b >= a for a, b in zip(series.energies, series.energies[1:]))
    assert series.shaping.startswith(f"shaped by power_W (window 25 ms, lag {lag * 1000:g} ms assumed; placement ")


@pytest.mark.parametrize("offset, lag", [(0.0, 0.0), (0.055, 0.011)], ids=["with the counter", "H200"])
def test_a_shaped_counter_with_wandering_steps_and_two_marks_per_boundary(offset, lag):
    """``test_a_period_holding_two_marks_shares_its_energy_among_three_segments`` (70-130 ms steps) with
    Lightning's second mark at every boundary."""
    rng = random.Random(11)
    changes, t = [], T0 + 3.0213
    while t < T0 + 6.0:
        changes.append(t)
        t += rng.uniform(0.07, 0.13)
    marks, steps = with_second_marks(changes, rng)
    trace = idle_then_square([c - T0 for c in changes], rng)
    counter = Counter(trace, [u + rng.uniform(-0.0005, 0.0005) for u in schedule()])
    reads, t = [], T0
    while t < T0 + 6.5:
        reads.append(t)
        t += 0.05 + rng.uniform(0.0, 0.002)
    series, figures = SensorSeries(ShapedCounterSensor(lag)), {}
    feed_shaped(series, trace, counter, reads, marks, figures, offset, lag)
    errors = [e - g for e, g in zip(step_errors_between(trace, steps[5:], figures),
                                    gap_share(trace, steps[5:], changes))]
    assert len(errors) > 20 and statistics.median(errors) < 0.01 and max(errors) < 0.2, (
        statistics.median(errors), max(errors))


# ------------------------------------------------------------------ plain counters and power sensors
def feed_pairs(series: SensorSeries, value, changes: list[float], reads: list[float], rng: random.Random):
    marks, steps = with_second_marks(changes, rng)
    return feed_with_marks(series, reads, value, marks), steps


def test_the_counter_neighbour_rule_keeps_its_accuracy_with_two_marks_per_boundary():
    """``test_nvml_like_counter_with_marks_attributes_steps_within_the_update_placement`` (300 ms steps on a
    100 ms counter) with the second mark 0.5-3 ms after each change."""
    rng = random.Random(3)
    changes = [T0 + 0.513 + 0.3 * k for k in range(28)]
    trace = square_at_marks([c - T0 for c in changes])
    series = SensorSeries(CounterSensor())
    figures, steps = feed_pairs(series, Counter(trace, schedule()).read, changes, drifting_reads(190), rng)
    steps = [(a, b) for a, b in steps if a > T0 + 4.0]  # once the phase is pinned down
    for (a, b), error, share in zip(steps, step_errors_between(trace, steps, figures),
                                    gap_share(trace, steps, changes)):
        # each edge off by the update placement (~0.5 ms) × the 100 W swing (one mark: the same)
        assert (error - share) * (trace.energy(b) - trace.energy(a)) <= 2 * 100.0 * 1e-3


def test_a_pair_of_marks_across_a_counter_update_is_no_neighbour_of_the_next_boundary():
    """A boundary's two marks on either side of a counter update (its middle before it): the period after
    the update holds its second mark only. Counting each mark, that period "held marks", so the next
    boundary, in the middle of the period after it, had a neighbour with marks and stayed linear (its steps
    about 25 ms × 100 W off); as one boundary, it is not a neighbour's, and the next boundary gets its step."""
    updates = schedule()  # .037 + k / 10
    pattern = [(u - 0.0024, u + 0.0006, u + PERIOD + 0.05) for u in updates[4::4] if T0 + 0.3 < u < T0 + 9.0]
    changes = sorted(c for first, _, b in pattern for c in (first, b))
    starts = sorted(second for _, second, _ in pattern) + [b for _, _, b in pattern]
    trace = square_at_marks([c - T0 for c in changes])
    series = SensorSeries(CounterSensor())
    figures = feed_with_marks(series, drifting_reads(190), Counter(trace, updates).read, sorted(changes + starts))
    starts.sort()
    steps = [(a, min(c for c in changes if c > a)) for a in starts if T0 + 4.0 < a < changes[-1]]
    errors = step_errors_between(trace, steps, figures)
    assert len(errors) >= 20
    for (a, b), error, share in zip(steps, errors, gap_share(trace, steps, changes)):
        assert (error - share) * (trace.energy(b) - trace.energy(a)) <= 2 * 100.0 * 1e-3, (a - T0, error)


def test_an_exact_counter_rebuilds_one_step_for_a_pair_of_marks():
    """``test_counter_exact_at_reads_rebuilds_a_step_at_its_mark`` (RAPL-like) with the second mark. A pair
    between two reads: points at both marks, each exact for a step anywhere between them. A pair across a
    read: counting each mark, both read intervals held marks and each was the other's neighbour, so both
    stayed linear; as one boundary, the interval holding its middle gets the step, off by at most half of
    the gap's swing."""
    rng = random.Random(4)
    changes = [T0 + 0.113 + 0.3 * k for k in range(19)]
    trace = square_at_marks([c - T0 for c in changes])
    figures, steps = feed_pairs(SensorSeries(CounterSensor(period=None)), trace.energy, changes,
                                [T0 + 0.05 * k for k in range(120)], rng)
    errors = step_errors_between(trace, steps, figures)
    assert len(errors) == len(steps)
    for error, share in zip(errors, gap_share(trace, steps, changes)):
        assert error <= share + 1e-12
    exact = sum(error < 1e-12 for error in errors)
    assert exact >= len(errors) // 2, exact  # both marks of each edge between two reads: exact


def test_a_power_sensor_takes_a_pair_of_marks_as_one_change():
    """Power sensors already held the mean between two marks of one interval (the same energy as one change
    in their middle); as one boundary, equal readings around a pair add no points, and a pair's stretch is
    no longer bounded by the whole range of powers read (that stands for steps shorter than the interval)."""
    series = SensorSeries(PowerSensor())
    series.add_reading(T0, 300.0)  # a wide range of powers read so far
    series.add_reading(T0 + 0.05, 50.0)
    series.add_reading(T0 + 0.1, 50.0, breakpoints=[T0 + 0.07, T0 + 0.072])
    assert series.times == [T0, T0 + 0.05, T0 + 0.1]  # no change: nothing added
    series.add_reading(T0 + 0.15, 150.0, breakpoints=[T0 + 0.12, T0 + 0.122])
    assert series.times == pytest.approx([T0, T0 + 0.05, T0 + 0.1, T0 + 0.121, T0 + 0.15])
    assert series.energy_at(T0 + 0.12) - series.energy_at(T0 + 0.1) == pytest.approx(50.0 * 0.02)
    assert series.energy_at(T0 + 0.15) - series.energy_at(T0 + 0.122) == pytest.approx(150.0 * 0.028)
    # the bound around the pair: 100 W swing over the interval, as for one mark (not 250 W over the gap)
    assert series_module.window_bound_J(series, T0 + 0.122, T0 + 0.15) == pytest.approx(100.0 * 0.028)


# ------------------------------------------------------------------ a counter's first reading
@pytest.mark.parametrize("watts", [200.0, 300.0])
def test_the_first_window_after_acquisition_is_not_a_period_high(watts):
    """A 100 ms counter at constant power, acquired at 20 phases of its updates, read every 50 ms + 0-2 ms;
    the first window runs 0.35 s from just after the first read (an epoch of a short fit, a test loop, a
    resumed epoch). The first value is that of an update up to a period before its read: at the read it
    put up to a period's energy into the first window (+14 % on average here, +27 % at worst). At the
    update before the next one, the window is off by where the updates are placed: within half a read
    interval (the reads bracket them 50 ms apart), on average nothing."""
    rng = random.Random(2)
    trace = Trace([(-1.0, watts)])
    errors = []
    for k in range(20):
        updates = schedule(phase=0.005 * k)
        series = SensorSeries(CounterSensor())
        reads, t = [], T0 + 0.5
        while t < T0 + 1.5:
            reads.append(t)
            t += 0.05 + rng.uniform(0.0, 0.002)
        start, end = reads[0] + 0.001, reads[0] + 0.351
        figures = feed_with_marks(series, reads, Counter(trace, updates).read, [start, end])
        exact = trace.energy(end) - trace.energy(start)
        errors.append((figures[end] - figures[start] - exact) / exact)
        assert abs(figures[end] - figures[start] - exact) <= series_module.window_bound_J(series, start, end) + 1e-9
        assert abs(errors[-1]) <= watts * 0.026 / exact + 1e-9  # half a read interval and its lateness
    assert abs(statistics.mean(errors)) < 0.01, statistics.mean(errors)


def test_no_covered_figure_moves_when_the_first_point_is_placed():
    """The first point moves back to the update its value came from only once the next update is placed;
    until then nothing after the earliest time it may move to is covered (a mark there waits), and a mark
    before that time keeps the first value for good."""
    trace = Trace([(-1.0, 100.0)])
    counter = Counter(trace, schedule())
    series = SensorSeries(CounterSensor())
    first = T0 + 0.01  # the value read here is that of the update at -0.063
    series.add_reading(first, counter.read(first))
    assert series.last_time_s == pytest.approx(first - PERIOD)
    assert not series.covers(first) and not series.covers(first - 0.05) and series.covers(first - 0.11)
    early = series.energy_at(first - 0.11)
    series.add_reading(T0 + 0.06, counter.read(T0 + 0.06))  # sees the update at 0.037
    assert series.covers(first) and series.energy_at(first - 0.11) == early
    assert series.times[0] == pytest.approx(0.035 - PERIOD + T0)
    assert series.energy_at(first) == pytest.approx(trace.energy(first) - trace.energy(T0 - 0.063)
                                                    + series.energies[0], abs=100.0 * 0.0025)


def test_reads_slower_than_the_counter_leave_the_first_point_at_its_read():
    trace = Trace([(-1.0, 100.0)])
    series = SensorSeries(CounterSensor())
    reads = [T0 + 0.013 + 0.25 * i for i in range(4)]
    for t in reads:
        series.add_reading(t, Counter(trace, schedule()).read(t))
    assert series.times == reads and series.last_time_s == reads[-1]


# ------------------------------------------------------------------ a power reading off the model
def shaped_with_refreshes(refreshes: list[float], trace: Trace, reads: list[float], marks: list[float]):
    """A shaped counter whose power reading refreshes at ``refreshes`` (the mean of the 25 ms before each),
    and the same counter read without it; the marks' figures of both."""
    counter = Counter(trace, schedule())
    shaped, plain = SensorSeries(ShapedCounterSensor()), SensorSeries(CounterSensor())
    shaped_figures, pending, upcoming = {}, [], sorted(marks)
    for t in reads:
        while upcoming and upcoming[0] <= t:
            pending.append(upcoming.pop(0))
        end = max(r for r in refreshes if r <= t)
        shaped.add_reading(t, counter.read(t), breakpoints=list(pending),
                           shape_w=(trace.energy(end) - trace.energy(end - 0.025)) / 0.025)
        while pending and shaped.covers(pending[0]):
            m = pending.pop(0)
            shaped_figures[m] = shaped.energy_at(m)
    plain_figures = feed_with_marks(plain, reads, counter.read, marks)
    return shaped, shaped_figures, plain_figures


@pytest.mark.parametrize("schedule_kind", ["every 150 ms", "at random"])
def test_a_power_reading_off_the_counters_schedule_falls_back_to_the_plain_rule(schedule_kind):
    """The 25 ms / 11 ms model comes from one H200; a card whose power field refreshes on another schedule
    must not be shaped by windows placed on a schedule it does not keep. Checked at run time: the series
    falls back to the plain counter rule, labelled, and from then on gives the plain rule's figures."""
    rng = random.Random(9)
    if schedule_kind == "every 150 ms":
        refreshes = [T0 - 1.0 + 0.0213 + 0.15 * k for k in range(200)]
    else:
        refreshes, t = [], T0 - 1.0
        while t < T0 + 30.0:
            refreshes.append(t)
            t += rng.uniform(0.03, 0.17)
    changes = [0.0213 + 0.3 * k for k in range(1, 90)]
    trace = idle_then_square(changes, rng)
    marks = [T0 + c for c in changes]
    reads, t = [], T0
    while t < T0 + 28.0:
        reads.append(t)
        t += 0.05 + rng.uniform(0.0, 0.002)
    series, shaped_figures, plain_figures = shaped_with_refreshes(refreshes, trace, reads, marks)
    assert series.shaping.startswith("plain counter rule: "), series.shaping
    assert "power_W" in series.shaping and series.shape.fallback is not None
    later = [m for m in marks if m > T0 + 20.0]
    for a, b in zip(later, later[1:]):
        assert shaped_figures[b] - shaped_figures[a] == pytest.approx(plain_figures[b] - plain_figures[a], abs=1e-9)


def test_a_power_reading_on_the_counters_schedule_keeps_shaping():
    rng = random.Random(9)
    refreshes = [u + 0.055 for u in schedule(until=30.0)]
    changes = [0.0213 + 0.3 * k for k in range(1, 90)]
    trace = idle_then_square(changes, rng)
    reads, t = [], T0
    while t < T0 + 28.0:
        reads.append(t)
        t += 0.05 + rng.uniform(0.0, 0.002)
    series, _, _ = shaped_with_refreshes(refreshes, trace, reads, [T0 + c for c in changes])
    assert series.shaping.startswith("shaped by power_W (window 25 ms, lag 0 ms assumed; placement ")
    assert SensorSeries(CounterSensor()).shaping is None and SensorSeries(PowerSensor()).shaping is None
