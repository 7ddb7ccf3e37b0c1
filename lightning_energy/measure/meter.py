"""Windows over the shared sample stream: marks, measurements and per-tag totals.

A callback asks its :class:`Meter` for a :class:`Mark` at a boundary (cheap: a timestamp or CUDA
event appended to a deque, no lock). The sampling thread resolves marks to cumulative energies per
sensor once samples cover them, and turns queued windows into :class:`Measurement` objects, summed per
tag and optionally queued for the training thread to log.

Step figures never wait: they are delivered once resolved. Waits for resolution (:meth:`Meter.wait`,
bounded, never reading a sensor) happen where a figure must be known at once: epoch and loop ends
(DDP epochs), the fit's end, and the decisions some callbacks take inside training (the power-limit
search, precision, batch-size and Zeus batch-size choices, the forecast, the catalog, energy to
accuracy, the profiler's windows, the pre-run probe): once per window or decision, not per step.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lightning_energy.measure.clocks import HostClock
from lightning_energy.measure.series import bound_between


class Mark:
    """A boundary on the sampler's clock: ``t`` (s) and, once resolved, cumulative J per sensor.

    ``stale``: sensors that had failed before ``t``; their energy here is frozen at their last good sample.
    ``extrapolated_sensors``: sensors extrapolated past their last sample because a wait ran out.
    """

    __slots__ = ("t", "token", "energy", "bounds", "extrapolated", "extrapolated_sensors", "stale")

    def __init__(self, token: Any, t: float | None) -> None:
        self.token = token
        self.t = t
        self.energy: dict[str, float | None] | None = None
        self.bounds: dict[str, Any] = {}  # per sensor, what the samples tell of the energy here (series.EdgeBound)
        self.extrapolated = False
        self.extrapolated_sensors: tuple[str, ...] = ()  # sensors whose samples did not reach ``t`` in time
        self.stale: tuple[str, ...] = ()

    @property
    def resolved(self) -> bool:
        return self.energy is not None


class EnergyWindow:
    """Totals of a window with ``energy_J`` (J per sensor) and ``duration_s`` (s)."""

    @property
    def total_J(self) -> float:
        return sum(self.energy_J.values())

    @property
    def mean_power_W(self) -> float:
        return self.total_J / self.duration_s if self.duration_s > 0 else math.nan


@dataclass(frozen=True)
class Measurement(EnergyWindow):
    """Energy (J) per sensor over ``[start_s, end_s]`` (sampler clock, s).

    ``missing``: sensors whose figures do not cover the whole window (failed before or inside it, or
    never read); a sensor that failed inside the window still has its energy up to its last good sample.
    """

    start_s: float
    end_s: float
    energy_J: dict[str, float]
    missing: tuple[str, ...] = ()
    extrapolated: bool = False
    bound_J: float = math.nan  # attribution bound of total_J (series.bound_between, summed; inf: an edge extrapolated)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s



def measure(start: Mark, end: Mark) -> Measurement:
    """The measurement between two resolved marks.

    A sensor that fails inside the window counts up to its last good sample (and is ``missing``); one
    that failed before the window counts nothing (and is ``missing``).
    """
    energy, missing = {}, []
    for name, e_end in end.energy.items():
        e_start = start.energy.get(name)
        if e_end is None or e_start is None or name in start.stale:
            missing.append(name)
            continue
        energy[name] = e_end - e_start
        if name in end.stale or name in end.extrapolated_sensors or name in start.extrapolated_sensors:
            missing.append(name)
    bound = sum(bound_between(start.bounds.get(n), end.bounds.get(n)) for n in energy) if energy else 0.0
    return Measurement(start.t, end.t, energy, tuple(missing), start.extrapolated or end.extrapolated, bound)


@dataclass
class Totals:
    """Running sums of the windows of one tag."""

    energy_J: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    count: int = 0

    def add(self, m: Measurement) -> None:
        for name, joules in m.energy_J.items():
            self.energy_J[name] = self.energy_J.get(name, 0.0) + joules
        self.duration_s += m.duration_s
        self.count += 1

    @property
    def total_J(self) -> float:
        return sum(self.energy_J.values())


class Meter:
    """Marks and windows over a subset of the shared sampler's sensors."""

    def __init__(self, sampler, sensor_names: list[str], clock=None) -> None:
        self.sampler = sampler
        self.sensor_names = list(sensor_names)
        self.clock = clock or HostClock()
        self._pending_marks: deque[Mark] = deque()
        self._pending_windows: deque = deque()
        self.results: deque = deque()  # (info, Measurement) for windows queued with keep=True
        self.totals: dict[Any, Totals] = {}
        self._resolved = threading.Condition()

    def __repr__(self) -> str:
        return f"Meter(sensors={self.sensor_names!r}, clock={self.clock!r})"

    # --- training thread ----------------------------------------------------------------------
    def mark(self) -> Mark:
        token = self.clock.record()
        mark = Mark(token, None if self.clock.asynchronous else token)
        self._pending_marks.append(mark)
        return mark

    def add_window(self, start: Mark, end: Mark, tag: Any = None, info: Any = None, keep: bool = False) -> None:
        """Queue a window; when resolved it is added to ``totals[tag]`` (unless ``tag`` is None) and, if
        ``keep``, to ``results``."""
        self._pending_windows.append((start, end, tag, info, keep))

    def wait(self, mark: Mark, timeout_s: float | None = None) -> Mark:
        """Block until ``mark`` is resolved, at most ``timeout_s`` (default: the sampler's resolution bound).

        Never reads a sensor and never waits on a lock held during a read: the sampling thread resolves
        marks as it samples and wakes this wait. Past the bound, sensors whose samples do not reach the
        mark yet are extrapolated from their last power and the mark says so (``extrapolated``,
        ``extrapolated_sensors``). An asynchronous (device) mark is never given host time: past the bound
        the wait blocks on the device until the boundary has executed, then waits (the same bound again)
        for samples to cover that time, so that a boundary the device reached late is still measured;
        only past that second bound is it extrapolated. Also guarantees that every window queued before
        ``mark`` is resolved.
        """
        if mark.resolved:
            return mark
        if timeout_s is None:
            timeout_s = self.sampler.resolution_timeout_s()
        deadline = time.perf_counter() + timeout_s
        self.sampler.request_sample()  # one prompt tick (sensors are still read only when due)
        with self._resolved:
            while not mark.resolved:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._resolved.wait(timeout=remaining)
        if not mark.resolved and self.clock.asynchronous:
            if mark.t is None:
                mark.t = self.clock.wait(mark.token)  # blocks on the device: never host time for a device mark
            # the device got there late (now, or shortly before the first bound ran out, when the sampling
            # thread learned its time): samples after it may still be on their way
            self.wait_until_covered(mark.t, timeout_s)
        if not mark.resolved:
            self.sampler.force_resolve(self, mark)  # measured where covered, extrapolated (and flagged) where not
        return mark

    def wait_until_covered(self, t: float, timeout_s: float | None = None) -> bool:
        """Block (bounded) until every live sensor of this meter has samples at or after ``t`` (s).

        False when the bound ran out (figures at ``t`` are then extrapolated by the caller). Never reads a
        sensor.
        """
        if timeout_s is None:
            timeout_s = self.sampler.resolution_timeout_s()
        deadline = time.perf_counter() + timeout_s
        self.sampler.request_sample()
        # coverage is checked outside the condition's lock (it takes the sampler's data lock, which the
        # sampling thread holds while it notifies): a notification missed in between costs one interval
        while self.sampler.covered_until(self.sensor_names) < t:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return False
            with self._resolved:
                self._resolved.wait(timeout=min(remaining, self.sampler.interval_s))
        return True

    # --- sampling thread ----------------------------------------------------------------------
    def resolve_device_times(self) -> None:
        """Give the pending device marks the device has reached their host times, in order (never blocks).

        The sampler calls it before each tick's readings are added, so that a boundary the device has
        passed counts as a boundary for those readings (the series' boundary rule) as a host mark would.
        """
        if not self.clock.asynchronous:
            return
        for mark in tuple(self._pending_marks):  # appended to without a lock: copied in one C call
            if mark.t is None:
                t = self.clock.resolve(mark.token)
                if t is None:
                    return  # the device has not reached it, nor any later mark of its stream
                mark.t = t

    def oldest_pending_time(self) -> float | None:
        marks = self._pending_marks
        return marks[0].t if marks and marks[0].t is not None else None

    def resolve(self, series: dict, force_until: Mark | None = None) -> None:
        """Resolve what the samples cover; with ``force_until``, extrapolate up to that mark.

        A failed sensor resolves at once: interpolated before its last good sample, frozen there after
        (the mark lists it in ``stale``), so energy measured before a failure is never lost.
        """
        try:
            self._resolve_marks(series, force_until)
        finally:  # a clock that raised still wakes the waits (they go on to their bound)
            with self._resolved:
                self._resolved.notify_all()

    def _resolve_marks(self, series: dict, force_until: Mark | None) -> None:
        marks = self._pending_marks
        while marks:
            mark = marks[0]
            forcing = force_until is not None
            if mark.t is None:
                mark.t = self.clock.resolve(mark.token)
                if mark.t is None:
                    break  # the device has not reached it: never substitute host time
            energy, stale = {}, []
            for name in self.sensor_names:
                s = series.get(name)
                if s is None:
                    energy[name] = None
                elif s.covers(mark.t):
                    energy[name] = s.energy_at(mark.t)
                    mark.bounds[name] = s.edge_bound(mark.t)
                elif not s.live:
                    energy[name] = s.last_energy_J
                    stale.append(name)
                elif forcing:
                    energy[name] = s.extrapolate(mark.t)
                    mark.extrapolated = True
                    mark.extrapolated_sensors += (name,)
                else:
                    break
            else:
                mark.stale = tuple(stale)
                mark.energy = energy
                marks.popleft()
                # windows ending here are published before any later mark resolves: a reader that sees a
                # mark resolved finds every window that ended before it in ``results`` already
                self._resolve_windows()
                if mark is force_until:
                    force_until = None
                continue
            break
        self._resolve_windows()

    def _resolve_windows(self) -> None:
        windows = self._pending_windows
        while windows and windows[0][1].resolved:
            start, end, tag, info, keep = windows.popleft()
            m = measure(start, end)
            if tag is not None:
                self.totals.setdefault(tag, Totals()).add(m)
            if keep:
                self.results.append((info, m))
