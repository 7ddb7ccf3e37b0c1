"""Attribution fidelity: per-step and per-epoch energy figures against known power traces.

Sensors with known traces are fed to the per-sensor series exactly as the sampler feeds them
(``SensorSeries.add_reading`` at each tick, with the times of the marks still pending up to the tick as
``breakpoints``), and marks are resolved as the Meter resolves them: in order, once the series covers
them, reading ``energy_at`` and ``edge_bound`` there. Figures and bounds are those read at resolution
(the run checks that no covered figure changes afterwards: ``figures_changed_after_resolution``). No
thread and no real time: every clock is simulated.

- Ticks: every 50 ms (the sampler's default) plus 0–2 ms (the tick's own cost and the thread's wake-up
  lateness), so the read phase wanders as a real sampler's does. A second schedule reads on an exact
  50 ms grid (the worst case for the counter phase estimate: the reads never come near the update).
- ``power`` sensor: reads the instantaneous power of the trace at each tick (RAPL-like, CPU estimate).
- ``counter`` sensor (NVML ``nvmlDeviceGetTotalEnergyConsumption``-like): integrates the true trace and
  updates every 100 ms on its own schedule (phase 37 ms, ±0.5 ms jitter per update); a read returns the
  value of its latest update.
- ``counter+power`` sensor (NVML on A100/H100/H200): the counter above, and the instant power as measured on
  an H200 (``benchmarks/nvml_semantics.py``): refreshed every 100 ms on its own schedule, 55 ms after the
  counter's updates, holding the mean over the 25 ms ending 11 ms before each refresh (the ~25 % of each
  100 ms the card's power sensor observes), which the series uses to share each period's exact energy out
  around its marks.
- Traces: constant 100 W; square waves alternating 50/150 W every step for steps of 20, 100, 300 and
  1000 ms (the power changes exactly at the step boundaries); the 300 ms square wave with its power
  redrawn every 10 ms within ±10 % of its level (noise the readings sample); a triangle ramp
  50→150→50 W over 2 s with 100 and 300 ms steps (the power does NOT change at the boundaries).
- Windows: contiguous steps (marks at the step boundaries) and epochs of about 10 s (an even number of
  steps), after 1 s of warm-up; 6 epochs per case.
- Rules: ``old`` is the rule of ``lightning_energy/series.py`` as of commit 6b08070 (trapezoid; counter
  points at the read that saw the move), computed from the readings by :class:`ReadingsBaseline` (numpy,
  no product code); ``unaware`` is the current
  ``SensorSeries`` fed without marks, which is the rule of commit 9bd5f86 (trapezoid; counter points at
  their estimated update times, linear between them); ``new`` is the current ``SensorSeries`` fed the
  marks (the boundary rule: power changes at the marks; see ``lightning_energy/measure/series.py``).
- Error: ``|figure − exact| / exact`` per window (%), median, 95th percentile and max. The bound is
  ``lightning_energy.measure.series.bound_between`` of the edges recorded at resolution (new rule only): ``holds``
  is the share of step windows whose error is within it, ``bound`` its median as a % of the step energy.
- Resolution delay: how long after a mark (ms of simulated time) the tick that resolved it came.

Sampling limit: for the power-sensor cases that miss the epoch goal (20 ms steps, ±10 % noise), the
rule's epoch error is set beside the best estimate the same readings allow (:func:`sampling_limit`,
over ``--limit-seeds`` seeds), with faster reads (10 ms), and with readings that are the mean power
since the previous read (a sensor averaging over its own read interval) summed exactly.

Goals (issue 12, "Attribution quality"): per-step error <= 5 % for steps >= 2 sampling intervals
(judged on the median and on the 95th percentile), epochs <= 0.1 % on power sensors (judged on the max);
DDP epoch power exact (a real 2-rank gloo fit; ``--no-ddp`` skips it).

Run: ``.venv/bin/python benchmarks/fidelity.py [--epochs 6] [--seed 0] [--no-ddp]``.
Writes ``benchmarks/results/fidelity.json`` (settings, per-case figures, goals, machine).
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402

from lightning_energy.measure.sensors.base import Sensor  # noqa: E402
from lightning_energy.measure.series import SensorSeries, bound_between  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported: benchmarks/machine.py
from machine import machine_info, write_json_atomic  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fidelity.json"
T0 = 5000.0  # where the sampler's clock stands when the trace starts (s)
TICK_S = 0.05  # the sampler's default interval
TICK_LATENESS_S = 0.002  # each tick comes 0-2 ms late (its own cost, wake-up lateness)
COUNTER_PERIOD_S = 0.1  # NVML's energy counter
COUNTER_PHASE_S = 0.037
COUNTER_JITTER_S = 0.0005
SHAPE_WINDOW_S = 0.025  # A100/H100/H200: the power sensor observes ~25 ms of each 100 ms
SHAPE_LAG_S = 0.011  # H200, measured: the window ends 11 ms before the instant field refreshes
SHAPE_OFFSET_S = 0.055  # H200, measured 38-82 ms: the field refreshes this long after the counter updates
WARMUP_S = 1.0
EPOCH_S = 10.0
GOAL_STEP_PCT = 5.0  # per-step error, for steps of at least two sampling intervals
GOAL_EPOCH_PCT = 0.1  # per-epoch error on power sensors
BASELINE_COMMIT = "6b08070"
UNAWARE_COMMIT = "9bd5f86"  # the rule before marks were passed to the series (reproduced by passing none)
NOISE = 0.1  # the noisy square wave: each 10 ms of it within ±10 % of its level
NOISE_BLOCK_S = 0.01


# ------------------------------------------------------------------------------- baseline (old rule)
class ReadingsBaseline:
    """BASELINE: the rule of ``lightning_energy/series.py`` at commit 6b08070, computed here from the readings
    (no product code): every reading at the time it was read, linear in between. Power sensors: the
    cumulative trapezoid of the readings; counters: a point at each read that saw the counter move, or
    after 1.5 periods without a move (zero power), holding the value read.
    """

    STALE_COUNTER_PERIODS = 1.5

    def __init__(self, sensor: Sensor) -> None:
        self.kind = sensor.kind
        self.period_s = getattr(sensor, "counter_update_period_s", None)
        self.times: list[float] = []
        self.energies: list[float] = []
        self._last_power: float | None = None

    def add_reading(self, t: float, value: float) -> None:
        if self.kind == "power":
            step = 0.0 if self._last_power is None else (t - self.times[-1]) * (self._last_power + value) / 2.0
            self.times.append(t)
            self.energies.append((self.energies[-1] if self.energies else 0.0) + step)
            self._last_power = value
        elif (not self.times or value != self.energies[-1] or self.period_s is None
              or t - self.times[-1] >= self.STALE_COUNTER_PERIODS * self.period_s):
            self.times.append(t)
            self.energies.append(value)

    def energy_at(self, t: float) -> float:
        return float(np.interp(t, self.times, self.energies))


# ------------------------------------------------------------------------------------------ sensors
class PowerSensor(Sensor):
    def __init__(self) -> None:
        super().__init__("power", "host", source="simulated instantaneous power")

    def power_w(self) -> float:
        raise AssertionError("fed by the benchmark")


class CounterSensor(Sensor):
    counter_update_period_s = COUNTER_PERIOD_S

    def __init__(self) -> None:
        super().__init__("counter", "device", source="simulated NVML-like energy counter")

    def energy_j(self) -> float:
        raise AssertionError("fed by the benchmark")


class ShapedCounterSensor(CounterSensor):
    """NVML on A100/H100/H200: the counter plus the instant-power field, the mean of the power over the
    ``SHAPE_WINDOW_S`` the power sensor observes, ending ``SHAPE_LAG_S`` before each of the field's refreshes."""

    shape_window_s = SHAPE_WINDOW_S
    shape_lag_s = SHAPE_LAG_S
    shape_power_field = "power_W"


# ------------------------------------------------------------------------------------------ traces
class Trace:
    """Piecewise-linear power: segments ``(t0, t1, p0, p1)`` (s from the trace start, W), exact integral."""

    def __init__(self, segments: list[tuple[float, float, float, float]]) -> None:
        self.segments = segments
        self.starts = [s[0] for s in segments]
        self.cumulative = [0.0]
        for t0, t1, p0, p1 in segments:
            self.cumulative.append(self.cumulative[-1] + (t1 - t0) * (p0 + p1) / 2.0)

    def _segment(self, t: float) -> int:
        return min(max(bisect.bisect_right(self.starts, t) - 1, 0), len(self.segments) - 1)

    def power(self, t: float) -> float:
        t0, t1, p0, p1 = self.segments[self._segment(t)]
        return p0 + (p1 - p0) * (t - t0) / (t1 - t0)

    def energy(self, t: float) -> float:
        i = self._segment(t)
        t0, t1, p0, p1 = self.segments[i]
        x = t - t0
        return self.cumulative[i] + x * (p0 + (p0 + (p1 - p0) * x / (t1 - t0))) / 2.0


def constant(duration: float) -> Trace:
    return Trace([(0.0, duration, 100.0, 100.0)])


def square(duration: float, step: float) -> Trace:
    n = math.ceil(duration / step)
    watts = [150.0 if k % 2 else 50.0 for k in range(n)]
    return Trace([(k * step, (k + 1) * step, watts[k], watts[k]) for k in range(n)])


def noisy_square(duration: float, step: float, noise: float = NOISE, block: float = NOISE_BLOCK_S) -> Trace:
    """The square wave with its power redrawn every ``block`` s within ±``noise`` of the level (seeded)."""
    rng = random.Random(1)
    segments, per_step = [], max(1, round(step / block))
    for k in range(math.ceil(duration / step)):
        level = 150.0 if k % 2 else 50.0
        for j in range(per_step):
            w = level * (1.0 + rng.uniform(-noise, noise))
            segments.append((k * step + j * step / per_step, k * step + (j + 1) * step / per_step, w, w))
    return Trace(segments)


def triangle(duration: float, half_period: float = 1.0) -> Trace:
    n = math.ceil(duration / half_period)
    return Trace([(k * half_period, (k + 1) * half_period, *((50.0, 150.0) if k % 2 == 0 else (150.0, 50.0)))
                  for k in range(n)])


@dataclass(frozen=True)
class Case:
    name: str
    step_s: float
    make: Callable[[float, float], Trace]


CASES = [
    Case("constant 100 W", 0.1, lambda d, s: constant(d)),
    Case("square 50/150 W", 0.02, square),
    Case("square 50/150 W", 0.1, square),
    Case("square 50/150 W", 0.3, square),
    Case("square 50/150 W", 1.0, square),
    Case("square 50/150 W ±10 %", 0.3, noisy_square),
    Case("ramp 50-150 W / 1 s", 0.1, lambda d, s: triangle(d)),
    Case("ramp 50-150 W / 1 s", 0.3, lambda d, s: triangle(d)),
]


# ------------------------------------------------------------------------------------------ simulation
def tick_times(duration: float, rng: random.Random, grid: bool) -> list[float]:
    if grid:
        return [T0 + TICK_S * k for k in range(int(duration / TICK_S) + 1)]
    times, t = [], T0 + rng.uniform(0.0, TICK_S)
    while t <= T0 + duration:
        times.append(t)
        t += TICK_S + rng.uniform(0.0, TICK_LATENESS_S)
    return times


def counter_updates(duration: float, rng: random.Random) -> list[float]:
    n = int(duration / COUNTER_PERIOD_S) + 2
    return [T0 + COUNTER_PHASE_S + k * COUNTER_PERIOD_S + rng.uniform(-COUNTER_JITTER_S, COUNTER_JITTER_S)
            for k in range(-1, n)]


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"median": statistics.median(ordered), "p95": p95, "max": ordered[-1], "n": len(ordered)}


def run_case(case: Case, sensor_kind: str, epochs: int, seed: int, grid: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    steps_per_epoch = max(2, 2 * round(EPOCH_S / case.step_s / 2))
    n_steps = steps_per_epoch * epochs
    warmup = math.ceil(WARMUP_S / case.step_s - 1e-9) * case.step_s  # marks on the trace's power changes
    duration = warmup + n_steps * case.step_s + 1.0
    trace = case.make(duration + 1.0, case.step_s)
    ticks = tick_times(duration, rng, grid)
    sensor = {"power": PowerSensor, "counter": CounterSensor, "counter+power": ShapedCounterSensor}[sensor_kind]()
    old, new, unaware = ReadingsBaseline(sensor), SensorSeries(sensor), SensorSeries(sensor)
    updates = counter_updates(duration, rng)
    marks = [warmup + k * case.step_s for k in range(n_steps + 1)]
    # the Meter's view: marks are created at their time; the sampler passes the pending ones (up to the
    # tick) with every reading, then the meter resolves, in order, those the series now covers, reading
    # energy_at and edge_bound there; a figure is what it was at resolution
    resolved = {id(new): {}, id(unaware): {}}  # mark -> (figure, EdgeBound) when it resolved
    waits = {id(new): [], id(unaware): []}  # ms from each mark to the tick that resolved it
    pending: list[float] = []  # marks the new series' meter still waits on (passed as breakpoints)
    pending_u: list[float] = []  # the same for the unaware series
    next_mark = 0
    for t in ticks:
        shape_w = None
        if sensor_kind == "power":
            value = trace.power(t - T0)
        else:
            i = bisect.bisect_right(updates, t) - 1
            value = trace.energy(updates[i] - T0)
            if sensor_kind == "counter+power":  # the window of the field's latest refresh (its own schedule)
                r = bisect.bisect_right(updates, t - SHAPE_OFFSET_S) - 1
                end = updates[r] + SHAPE_OFFSET_S - SHAPE_LAG_S - T0
                shape_w = (trace.energy(end) - trace.energy(end - SHAPE_WINDOW_S)) / SHAPE_WINDOW_S
        while next_mark < len(marks) and T0 + marks[next_mark] <= t:
            pending.append(marks[next_mark])
            pending_u.append(marks[next_mark])
            next_mark += 1
        old.add_reading(t, value)
        new.add_reading(t, value, breakpoints=[T0 + m for m in pending], shape_w=shape_w)
        unaware.add_reading(t, value, shape_w=shape_w)  # no marks passed: the trapezoid / linear counter rule (as at 9bd5f86)
        for series, queue in ((new, pending), (unaware, pending_u)):
            while queue and series.covers(T0 + queue[0]):
                m = queue.pop(0)
                resolved[id(series)][m] = (series.energy_at(T0 + m), series.edge_bound(T0 + m))
                waits[id(series)].append((t - T0 - m) * 1000.0)
    unresolved = len(pending) + len(pending_u)
    if unresolved:  # the trace runs 1 s past the last mark: every mark resolves
        raise RuntimeError(f"{unresolved} marks never resolved in case {case.name!r}")
    changed = sum(1 for m, (figure, _) in resolved[id(new)].items() if new.energy_at(T0 + m) != figure)

    def errors(series, windows) -> list[float]:
        if series is old:
            energy_at = lambda m: old.energy_at(T0 + m)  # noqa: E731 (appends only: final once covered)
        else:
            energy_at = lambda m: resolved[id(series)][m][0]  # noqa: E731
        out = []
        for a, b in windows:
            exact = trace.energy(b) - trace.energy(a)
            figure = energy_at(b) - energy_at(a)
            out.append(abs(figure - exact) / exact * 100.0)
        return out

    step_windows = list(zip(marks, marks[1:]))
    epoch_windows = [(marks[k * steps_per_epoch], marks[(k + 1) * steps_per_epoch]) for k in range(epochs)]
    figures = resolved[id(new)]
    held, bound_pct = 0, []
    for a, b in step_windows:
        exact = trace.energy(b) - trace.energy(a)
        error = abs(figures[b][0] - figures[a][0] - exact)
        bound = bound_between(figures[a][1], figures[b][1])  # the edges as recorded at resolution
        held += error <= bound + 1e-9
        bound_pct.append(bound / exact * 100.0)
    epoch_bound, epoch_held = [], 0
    for a, b in epoch_windows:
        exact = trace.energy(b) - trace.energy(a)
        bound = bound_between(figures[a][1], figures[b][1])
        epoch_held += abs(figures[b][0] - figures[a][0] - exact) <= bound + 1e-9
        epoch_bound.append(bound / exact * 100.0)
    result = {
        "trace": case.name,
        "sensor": sensor_kind,
        "reads": "50 ms grid" if grid else "50 ms + 0-2 ms",
        "step_ms": round(case.step_s * 1000),
        "step_in_sampling_intervals": case.step_s / TICK_S,
        "steps": len(step_windows),
        "epochs": epochs,
        "epoch_s": steps_per_epoch * case.step_s,
        "step_error_pct": {"old": stats(errors(old, step_windows)), "unaware": stats(errors(unaware, step_windows)),
                           "new": stats(errors(new, step_windows))},
        "epoch_error_pct": {"old": stats(errors(old, epoch_windows)),
                            "unaware": stats(errors(unaware, epoch_windows)), "new": stats(errors(new, epoch_windows))},
        "bound_new": {"step_holds_share": held / len(step_windows), "step_bound_pct": stats(bound_pct),
                      "epoch_holds_share": epoch_held / len(epoch_windows), "epoch_bound_pct": stats(epoch_bound)},
        "resolution_delay_ms": {"unaware": stats(waits[id(unaware)]), "new": stats(waits[id(new)])},
        "figures_changed_after_resolution": changed,
    }
    if sensor_kind != "power":
        phase = new.phase
        result["counter_phase"] = {
            "true_s": COUNTER_PHASE_S,
            "estimate_s": phase.center_s if phase is not None else None,
            "half_width_s": phase.half_width_s if phase is not None and phase.pinned else None,
        }
    return result


class IntervalMeanSensor(Sensor):
    """A power sensor that reports the mean power since its previous read, integrated as a counter exact
    at its reads (cumulative = sum of reading x interval)."""

    def __init__(self) -> None:
        super().__init__("interval_mean", "host", source="simulated mean power since the previous read")

    def energy_j(self) -> float:
        raise AssertionError("fed by the benchmark")


def sampling_limit(case: Case, tick_s: float, seeds: range, sensor_kind: str = "power") -> dict[str, Any]:
    """Epoch errors (%, over ``seeds``) of the new rule and of the best estimate the same readings allow.

    ``power``: instantaneous readings every ``tick_s`` (+0-2 ms). The best estimate knows what the rule
    assumes (power constant between marks): each step whose interval holds readings gets their mean, a
    step without one the mean of its nearest sampled neighbours. ``interval mean``: each reading is the
    mean power since the previous one (what a sensor averaging over its own read interval reports),
    summed exactly; the new rule is then fed the same readings as if instantaneous.
    """
    new_errors, best_errors = [], []
    for seed in seeds:
        rng = random.Random(seed)
        steps_per_epoch = max(2, 2 * round(EPOCH_S / case.step_s / 2))
        n_steps = steps_per_epoch * 3
        warmup = math.ceil(WARMUP_S / case.step_s - 1e-9) * case.step_s
        duration = warmup + n_steps * case.step_s + 1.0
        trace = case.make(duration + 1.0, case.step_s)
        ticks, t = [], T0 + rng.uniform(0.0, tick_s)
        while t <= T0 + duration:
            ticks.append(t)
            t += tick_s + rng.uniform(0.0, TICK_LATENESS_S)
        marks = [warmup + k * case.step_s for k in range(n_steps + 1)]
        new = SensorSeries(PowerSensor())
        exact_at_reads = SensorSeries(IntervalMeanSensor())
        readings, pending, next_mark, previous, total = [], [], 0, None, 0.0
        for t in ticks:
            if sensor_kind == "power" or previous is None:
                value = trace.power(t - T0)
            else:
                value = (trace.energy(t - T0) - trace.energy(previous - T0)) / (t - previous)
                total += value * (t - previous)
            previous = t
            while next_mark < len(marks) and T0 + marks[next_mark] <= t:
                pending.append(T0 + marks[next_mark])
                next_mark += 1
            new.add_reading(t, value, breakpoints=pending[-64:])
            exact_at_reads.add_reading(t, total, breakpoints=pending[-64:])
            readings.append((t - T0, value))
        for k in range(3):
            a, b = marks[k * steps_per_epoch], marks[(k + 1) * steps_per_epoch]
            exact = trace.energy(b) - trace.energy(a)
            figure = new.energy_at(T0 + b) - new.energy_at(T0 + a)
            new_errors.append(abs(figure - exact) / exact * 100.0)
            if sensor_kind == "power":
                best = best_from_readings(readings, marks, a, b, case.step_s)
            else:
                best = exact_at_reads.energy_at(T0 + b) - exact_at_reads.energy_at(T0 + a)
            best_errors.append(abs(best - exact) / exact * 100.0)

    def rms(values: list[float]) -> float:
        return math.sqrt(statistics.mean(v * v for v in values))

    best_name = "per-step mean of readings" if sensor_kind == "power" else "readings x intervals (exact at reads)"
    return {"trace": case.name, "step_ms": round(case.step_s * 1000), "tick_ms": round(tick_s * 1000),
            "readings": "instantaneous" if sensor_kind == "power" else "mean since previous read",
            "epochs": len(new_errors), "new": {"rms": rms(new_errors), "max": max(new_errors)},
            "best": {"estimator": best_name, "rms": rms(best_errors), "max": max(best_errors)}}


def best_from_readings(readings: list[tuple[float, float]], marks: list[float], a: float, b: float,
                       step_s: float) -> float:
    """Energy of ``[a, b]`` with each step at the mean of the readings inside it, an unsampled step at
    the mean of its nearest sampled neighbours' (the power is constant between marks)."""
    by_step: dict[int, list[float]] = {}
    for t, value in readings:
        if marks[0] <= t < marks[-1]:
            by_step.setdefault(int((t - marks[0]) // step_s), []).append(value)
    known = {k: statistics.mean(v) for k, v in by_step.items()}
    ordered = sorted(known)
    total = 0.0
    for k in range(round((a - marks[0]) / step_s), round((b - marks[0]) / step_s)):
        if k in known:
            total += known[k] * step_s
            continue
        i = bisect.bisect_left(ordered, k)
        total += statistics.mean(known[ordered[j]] for j in (i - 1, i) if 0 <= j < len(ordered)) * step_s
    return total


SAMPLING_LIMIT_CASES = [  # (case, read interval s, readings)
    (Case("square 50/150 W", 0.02, square), TICK_S, "power"),
    (Case("square 50/150 W", 0.02, square), 0.01, "power"),
    (Case("square 50/150 W", 0.02, square), TICK_S, "interval mean"),
    (Case("square 50/150 W ±10 %", 0.3, noisy_square), TICK_S, "power"),
    (Case("square 50/150 W ±10 %", 0.3, noisy_square), 0.01, "power"),
    (Case("square 50/150 W ±10 %", 0.3, noisy_square), TICK_S, "interval mean"),
]


def format_sampling_limit(rows: list[dict[str, Any]]) -> str:
    head = (f"{'trace':<24} {'step':>5} {'reads':>6} {'readings':<25} {'epoch error %, new':>18} "
            f"{'epoch error %, best from the readings':>44}")
    sub = f"{'':<24} {'ms':>5} {'ms':>6} {'':<25} {'rms     max':>18} {'rms     max  estimator':>44}"
    lines = [head, sub, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['trace']:<24} {r['step_ms']:>5} {r['tick_ms']:>6} {r['readings']:<25} "
                     f"{pct(r['new']['rms'])}  {pct(r['new']['max'])}     "
                     f"{pct(r['best']['rms'])}  {pct(r['best']['max'])}  {r['best']['estimator']}")
    return "\n".join(lines)


def goals_for(rows: list[dict[str, Any]]) -> dict[str, Any]:
    step_rows = [r for r in rows if r["step_in_sampling_intervals"] >= 2 - 1e-9]
    per_step = {}
    for r in step_rows:
        new = r["step_error_pct"]["new"]
        key = f"{r['trace']}, {r['step_ms']} ms, {r['sensor']}, reads {r['reads']}"
        per_step[key] = {"median": new["median"], "p95": new["p95"],
                         "met_median": new["median"] <= GOAL_STEP_PCT, "met_p95": new["p95"] <= GOAL_STEP_PCT}
    power_rows = [r for r in rows if r["sensor"] == "power"]
    per_epoch = {f"{r['trace']}, {r['step_ms']} ms steps": {"max": r["epoch_error_pct"]["new"]["max"],
                                                            "met": r["epoch_error_pct"]["new"]["max"] <= GOAL_EPOCH_PCT}
                 for r in power_rows}
    return {
        "step_error_pct_for_steps_of_2_sampling_intervals_or_more": {"goal_max": GOAL_STEP_PCT, "cases": per_step},
        "epoch_error_pct_power_sensors": {"goal_max": GOAL_EPOCH_PCT, "cases": per_epoch},
        "ddp_epoch_power_exact": {"goal": "power/epoch_W equals the sum of the sensors' powers", "measured": None,
                                  "met": None, "note": DDP_PLACEHOLDER["status"]},
    }


# The DDP case (issue 12, item 1): a real 2-rank CPU fit (gloo) of tests/ddp_epoch_fit.py, whose rank 0 works
# 0.3 s more at every epoch end; 10 W device sensor per rank + 20 W host sensor: every epoch must read 40 W.
DDP_EXPECTED_W = 2 * 10.0 + 20.0


def run_ddp_case(validation: str) -> dict[str, Any]:
    """Epoch power of the DDP fit vs the sum of the sensors' powers (relative error, %)."""
    import subprocess
    import tempfile

    script = Path(__file__).resolve().parents[1] / "tests" / "ddp_epoch_fit.py"
    with tempfile.TemporaryDirectory(prefix="le_fidelity_ddp_") as tmp:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, str(script), tmp, validation], capture_output=True, text=True,
                             env=env, timeout=300)
        if run.returncode != 0:
            return {"case": validation, "error": run.stderr[-2000:]}
        (report_path,) = Path(tmp).rglob("energy_report.json")
        report = json.loads(report_path.read_text())
    powers = [e["power_W"] for e in report["epochs"]]
    errors = [abs(p - DDP_EXPECTED_W) / DDP_EXPECTED_W * 100.0 for p in powers]
    return {"case": f"2 CPU ranks, 10 W device each + 20 W host, rank 0 +0.3 s per epoch end, validation "
                    f"{'on' if validation == 'val' else 'off'}, checkpointing off",
            "expected_power_W": DDP_EXPECTED_W, "epoch_power_W": powers, "max_error_pct": max(errors)}


DDP_PLACEHOLDER: dict = {"status": "not run (--no-ddp)"}


# ------------------------------------------------------------------------------------------ output
def pct(x: float) -> str:
    if x >= 99.95:
        return f"{x:6.0f}"
    return f"{x:6.3f}" if x < 9.9995 else f"{x:6.2f}"


def format_table(rows: list[dict[str, Any]], ddp: list[dict[str, Any]] | None = None) -> str:
    head = (f"{'trace':<24} {'sensor':<13} {'reads':<15} {'step':>5} {'steps/':>6} "
            f"{'step error %, old':>17} {'step err %, unaware':>19} {'step error %, new':>17} "
            f"{'epoch error % max':>24} {'bound (new)':>23} {'resolves, ms':>13}")
    head2 = (f"{'':<24} {'':<13} {'':<15} {'ms':>5} {'interv':>6} "
             f"{'median    p95':>17} {'median    p95':>19} {'median    p95':>17} "
             f"{'old   unaware      new':>24} {'holds step/ep med %':>23} {'unaware  new':>13}")
    lines = [head, head2, "-" * len(head)]
    for r in rows:
        so, su, sn = (r["step_error_pct"][k] for k in ("old", "unaware", "new"))
        eo, eu, en = (r["epoch_error_pct"][k]["max"] for k in ("old", "unaware", "new"))
        b = r["bound_new"]
        du, dn = r["resolution_delay_ms"]["unaware"]["max"], r["resolution_delay_ms"]["new"]["max"]
        lines.append(
            f"{r['trace']:<24} {r['sensor']:<13} {r['reads']:<15} {r['step_ms']:>5} "
            f"{r['step_in_sampling_intervals']:>6.1f} "
            f"{pct(so['median'])}  {pct(so['p95'])}     {pct(su['median'])}  {pct(su['p95'])}   "
            f"{pct(sn['median'])}  {pct(sn['p95'])}   "
            f"{pct(eo)}   {pct(eu)}   {pct(en)}   "
            f"{b['step_holds_share'] * 100:5.0f}%/{b['epoch_holds_share'] * 100:4.0f}%  "
            f"{pct(b['step_bound_pct']['median'])}   "
            f"{du:5.0f}  {dn:5.0f}")
    lines.append("")
    for case in ddp or ():
        if "error" in case:
            lines.append(f"{'DDP epoch power':<20} failed: {case['error'][-200:]}")
            continue
        lines.append(f"{'DDP epoch power':<20} {'all':<8} {case['case'][:60]:<60} expected {case['expected_power_W']:g} W, "
                     f"epochs {', '.join(f'{p:.9g}' for p in case['epoch_power_W'])} W: max error "
                     f"{case['max_error_pct']:.2e} %")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6, help="epochs of about 10 s per case (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tick and counter jitter (default 0)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP case (two gloo ranks, ~1 min)")
    parser.add_argument("--limit-seeds", type=int, default=10,
                        help="seeds (x 3 epochs) of the sampling-limit check (default 10)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("need --epochs >= 1")
    started = time.perf_counter()
    rows = []
    for i, case in enumerate(CASES):
        for sensor_kind in ("power", "counter", "counter+power"):
            rows.append(run_case(case, sensor_kind, args.epochs, args.seed + i, grid=False))
    for i, case in enumerate(CASES):  # the counter read on an exact 50 ms grid: the phase never narrows
        if not case.name.startswith("constant") and case.step_s >= 0.1:
            for sensor_kind in ("counter", "counter+power"):
                rows.append(run_case(case, sensor_kind, args.epochs, args.seed + i, grid=True))
    goals = goals_for(rows)
    limit_rows = [sampling_limit(case, tick, range(args.limit_seeds), kind)
                  for case, tick, kind in SAMPLING_LIMIT_CASES]
    ddp = None if args.no_ddp else [run_ddp_case("val"), run_ddp_case("noval")]
    if ddp is not None:
        errors = [case.get("max_error_pct", math.inf) for case in ddp]
        goals["ddp_epoch_power_exact"] = {"goal": "power/epoch_W equals the sum of the sensors' powers (within "
                                                  "float rounding, 1e-7 %)", "measured_max_error_pct": max(errors),
                                          "met": max(errors) <= 1e-7, "note": "real 2-rank gloo fits"}
    notes = [
        f"old: the rule of lightning_energy/series.py at commit {BASELINE_COMMIT}, computed from the readings by "
        "ReadingsBaseline (numpy; trapezoid; counter points at the read that saw the move); unaware: the current SensorSeries fed no "
        f"marks, i.e. the rule of commit {UNAWARE_COMMIT} (trapezoid; counter points at the estimated update "
        "time, linear between them); new: the current SensorSeries fed the pending marks as the sampler does "
        "(power: the change of a sample interval at its marks; counters: a step rebuilt at the marks of a "
        "period whose neighbouring periods hold none)",
        "steps/interv: step length in sampling intervals (50 ms); the step goal applies from 2 up. A 100 ms "
        "step is ONE update period of the 100 ms counter: every period then holds a boundary and the counter "
        "alone cannot say where in it the work changed (the new rule leaves such periods linear)",
        "bound: bound_between of the edges recorded at resolution (new rule); holds: share of step windows "
        "whose error is within it; step med %: its median as a share of the step energy. Counter bounds make no "
        "assumption on the power inside a counter period (one update's energy per edge); power-sensor bounds "
        "assume only that the power inside a sample interval stays between its two readings (not that it "
        "changes at the marks), which steps shorter than a sampling interval break",
        "resolves, ms: max delay from a mark to the tick that resolved it; new counter marks in a rebuilt "
        "period wait for the counter point after the period (one update period more)",
        "the counter's update phase is estimated from the reads; on an exact 50 ms grid the reads never come "
        "near the update and the phase stays known only within the 50 ms between reads",
        "the ±10 % noisy square wave: power readings are instantaneous samples of the noise (6 per 300 ms "
        "step), so its power-sensor step errors are mostly sampling noise that no placement of the change "
        "removes",
        "counter+power: the counter of the counter rows plus the instant power as an H200 has it (refreshed "
        "55 ms after each counter update, the mean of the 25 ms ending 11 ms before the refresh); on the exact "
        "50 ms grid the refresh phase is known only within 50 ms, so the windows cannot be placed (real reads "
        "jitter: the 50 ms + 0-2 ms rows)",
        "sampling limit: instantaneous readings of power that changes faster than the reads (20 ms steps, noise "
        "redrawn every 10 ms) alias: the rule's epoch error equals that of the best estimate from the same "
        "readings, and vanishes (steps) or shrinks (noise) at 10 ms reads. A sensor that reports the mean "
        "power since its previous read (e.g. a load-based estimate) is exact when summed as reading x interval; "
        "the power rule, which takes readings as instantaneous, is not (see the 'mean since previous read' rows)",
    ]
    table = format_table(rows, ddp)
    print(table)
    print()
    limit_table = format_sampling_limit(limit_rows)
    print("sampling limit (epochs of ~10 s, power sensors): the rule against the best estimate the same readings allow")
    print(limit_table)
    print()
    for name, goal in goals.items():
        if name == "ddp_epoch_power_exact":
            if goal.get("measured_max_error_pct") is None:
                print(f"goal {name}: {goal['note']}")
            else:
                print(f"goal {name}: max error {goal['measured_max_error_pct']:.2e} %: "
                      f"{'met' if goal['met'] else 'NOT met'}")
            continue
        cases = goal["cases"]
        met = [k for k, v in cases.items() if v.get("met", v.get("met_median"))]
        print(f"goal {name} (<= {goal['goal_max']} %): met in {len(met)} of {len(cases)} cases")
        for k, v in cases.items():
            figures = ", ".join(f"{m} {v[m]:.3f} %" for m in ("median", "p95", "max") if m in v)
            verdict = "met" if v.get("met", v.get("met_median")) else "NOT met"
            if "met_p95" in v:
                verdict += f" (p95 {'met' if v['met_p95'] else 'NOT met'})"
            print(f"  {k}: {figures}: {verdict}")
    for note in notes:
        print(f"note: {note}")
    result = {
        "benchmark": "fidelity",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - started,
        "settings": {
            "epochs": args.epochs, "seed": args.seed, "tick_s": TICK_S, "tick_lateness_s": [0.0, TICK_LATENESS_S],
            "counter": {"period_s": COUNTER_PERIOD_S, "phase_s": COUNTER_PHASE_S,
                        "update_jitter_s": [-COUNTER_JITTER_S, COUNTER_JITTER_S]},
            "warmup_s": WARMUP_S, "epoch_s_about": EPOCH_S,
            "baseline": {"rule": "old", "source": f"the rule of lightning_energy/series.py at commit {BASELINE_COMMIT}",
                         "computed_by": "ReadingsBaseline (numpy.interp over the readings, no product code)"},
        },
        "results": rows,
        "sampling_limit": {"rows": limit_rows, "table": limit_table.splitlines(), "seeds": args.limit_seeds},
        "ddp": ddp if ddp is not None else DDP_PLACEHOLDER,
        "goals": goals,
        "table": table.splitlines(),
        "notes": notes,
        "machine": machine_info(),
    }
    write_json_atomic(args.out, result)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
