"""The one background sampling thread of a process, shared by every callback of this suite.

Callbacks :meth:`Sampler.acquire` it with their sensors in ``setup`` and :meth:`Sampler.release` it in
``teardown``; the thread runs while anyone holds it. Each tick reads every sensor that is due (each at
most once per its ``min_read_interval_s``), appends to the bounded per-sensor series, lets the meters
resolve their marks and hands the readings to listeners (the trace writer).

Locks: the data lock guards the series, meters and listeners and is held only for bookkeeping, never
while a sensor is read or a listener writes; so the training thread, which never reads a sensor, never
waits behind a slow read either. A read that does not return within :data:`READ_TIMEOUT_S` is declared
hung by a watchdog: the sensor is flagged failed (its energy up to its last good sample stays counted)
and a fresh sampling thread takes over the other sensors; the stuck thread is abandoned and discards
whatever its read returns.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from lightning_energy.measure.meter import Mark, Meter
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.series import STALE_COUNTER_PERIODS, SensorSeries

# 20 Hz: twice the ~10 Hz update rate of NVML's energy counter; each tick costs ~75 us of CPU holding the GIL.
DEFAULT_INTERVAL_S = 0.05
MIN_INTERVAL_S = 0.001
KEEP_POINTS = 4096  # per sensor, beyond what pending marks and retained windows still need
# Longest a mark waits for samples before it is extrapolated: a few sampling intervals plus the counter's
# staleness rule, capped (a sensor slower than this is extrapolated and flagged instead of stalling).
RESOLUTION_INTERVALS = 3
MAX_RESOLUTION_WAIT_S = 1.0
SETUP_WAIT_S = 1.0  # bound of the once-per-fit wait for every new sensor's first sample (s)
READ_TIMEOUT_S = 2.0  # a single sensor read longer than this is declared hung
THREAD_JOIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Reading:
    """One sensor's values at one tick: cumulative J, power W, extra telemetry."""

    name: str
    energy_J: float
    power_W: float
    fields: dict


@dataclass(frozen=True)
class SensorFailure:
    name: str
    message: str
    t: float


class Sampler:
    """Background sampler; use :func:`get_sampler` for the process-wide instance."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.series: dict[str, SensorSeries] = {}
        self._users: dict[str, set] = {}  # sensor name -> owners using it
        self._owners: dict[object, float] = {}  # owner -> requested interval
        self._retained: dict[object, float] = {}  # owner -> oldest time (s) whose points it still needs
        self._meters: list[Meter] = []
        self._listeners: list[Callable[[float, list[Reading]], None]] = []
        self.failures: deque[SensorFailure] = deque()
        self.open_failures: list[str] = []  # one line per sensor dropped because open() raised
        self.interval_s = DEFAULT_INTERVAL_S
        self.samples_taken = 0
        self._lock = threading.RLock()  # the data lock: never held during a sensor read
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._generation = 0  # bumped when a hung thread is replaced; the old one then discards its work
        self._reading: tuple[int, SensorSeries, float] | None = None  # (generation, series, started at)
        self.hung: set[str] = set()  # sensors whose read never returned: never closed, never read again

    # --- life cycle -----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def acquire(self, owner: object, sensors: list[Sensor], interval_s: float = DEFAULT_INTERVAL_S,
                start_thread: bool = True) -> list[str]:
        """Register ``owner``'s sensors (opened here) and start the thread; returns the names in use.

        A sensor whose ``open()`` raises is dropped with one line in :attr:`open_failures` (and left out
        of the names returned); training goes on without it. Without the thread (``start_thread=False``,
        tests driving :meth:`sample_once` by hand) the sensors are read once here.
        """
        if not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"interval_s must be >= {MIN_INTERVAL_S} s, got {interval_s}")
        with self._lock:
            for sensor in sensors:
                self._check_name_is_free(sensor)
            self._owners[owner] = interval_s
            self.interval_s = min(self._owners.values())
            names = []
            for sensor in sensors:
                if sensor.name not in self.series:
                    try:
                        sensor.open()
                    except Exception as err:  # an unusable sensor is dropped, never fatal
                        self.open_failures.append(
                            f"sensor {sensor.name!r} ({sensor.source}) could not be opened and is not measured: "
                            f"{type(err).__name__}: {err}")
                        continue
                    self.series[sensor.name] = SensorSeries(sensor)
                self._users.setdefault(sensor.name, set()).add(owner)
                names.append(sensor.name)
        if not start_thread:
            self.sample_once()
            return names
        if not self.running:
            self._start_thread()
        self._wake.set()
        self._await_first_points(names)
        return names

    def _await_first_points(self, names: list[str]) -> None:
        """Wait (at set-up, bounded) until the thread has read each new sensor once, so that the first
        marks fall after a first point; a sensor still unread then is resolved like a late one."""
        self.await_coverage(names, since_s=-math.inf)

    def await_coverage(self, names: list[str], since_s: float | None = None) -> bool:
        """Wait until every live sensor of ``names`` has a sample at or after ``since_s`` (sampler clock, s;
        default: now), at most :data:`SETUP_WAIT_S`; False when the bound ran out. Never reads a sensor.

        For set-up only (once per fit, never per step): on a loaded machine a new or busy sampling thread
        can wait tens of ms for a core, and the fit's start mark must still fall after a sample that every
        listener (the trace) has seen.
        """
        since_s = self.clock() if since_s is None else since_s
        deadline = time.perf_counter() + max(self.resolution_timeout_s(), SETUP_WAIT_S)
        self.request_sample()
        while time.perf_counter() < deadline:
            with self._lock:
                if all(s.times and s.times[-1] >= since_s or not s.live
                       for n in names if (s := self.series.get(n)) is not None):
                    return True
            time.sleep(min(self.interval_s, 0.001))
        return False

    def _start_thread(self) -> None:
        self._stop.clear()
        generation = self._generation
        self._thread = threading.Thread(target=self._run, args=(generation,), name="lightning-energy-sampler",
                                        daemon=True)
        self._thread.start()
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, name="lightning-energy-watchdog", daemon=True)
            self._watchdog.start()

    def _check_name_is_free(self, sensor: Sensor) -> None:
        """Series are kept by sensor name: refuse a different sensor under a name already in use."""
        series = self.series.get(sensor.name)
        if series is None or series.sensor is sensor or series.sensor.identity() == sensor.identity():
            return
        raise ValueError(
            f"two different sensors are named {sensor.name!r}: {sensor!r} ({sensor.source}) and {series.sensor!r} "
            f"({series.sensor.source}), already in use by another callback. Callbacks share sensors by name, so "
            "give each sensor a distinct name, or pass the same sensor object to every callback"
        )

    def release(self, owner: object) -> None:
        """Drop ``owner``; close sensors nobody uses any more; stop the thread when nobody is left."""
        to_close = []
        with self._lock:
            self._owners.pop(owner, None)
            self._retained.pop(owner, None)
            for name in [n for n, users in self._users.items() if owner in users]:
                users = self._users[name]
                users.discard(owner)
                if not users:
                    del self._users[name]
                    to_close.append(self.series.pop(name))
            if self._owners:
                self.interval_s = min(self._owners.values())
            else:
                self.failures.clear()
                self.open_failures.clear()
        for series in to_close:
            if series.name in self.hung:
                continue  # a sensor stuck in a read would block here too
            try:
                series.sensor.close()
            except Exception:  # closing a broken sensor must not break teardown
                pass
        if not self._owners:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            reading = self._reading
            if reading is None or reading[0] != self._generation:
                thread.join(timeout=THREAD_JOIN_TIMEOUT_S)

    def add_meter(self, meter: Meter) -> None:
        with self._lock:
            self._meters.append(meter)

    def remove_meter(self, meter: Meter) -> None:
        with self._lock:
            if meter in self._meters:
                self._meters.remove(meter)

    def add_listener(self, listener: Callable[[float, list[Reading]], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def retain(self, owner: object, since_s: float | None) -> None:
        """Keep every point from ``since_s`` (sampler clock, s) on for ``owner``; ``None`` lets go.

        For figures computed at times known only later (DDP epochs over a common interval).
        """
        with self._lock:
            if since_s is None:
                self._retained.pop(owner, None)
            else:
                self._retained[owner] = since_s

    def request_sample(self) -> None:
        """Ask the thread for a tick now rather than at the next interval (sensors still read when due)."""
        self._wake.set()

    def resolution_timeout_s(self) -> float:
        """How long a wait for a mark may take before it is extrapolated (s)."""
        periods = [max(s.sensor.counter_update_period_s or 0.0, s.sensor.min_read_interval_s or 0.0)
                   for s in list(self.series.values())]
        longest = max([self.interval_s, *periods])
        return min(MAX_RESOLUTION_WAIT_S, RESOLUTION_INTERVALS * self.interval_s + (STALE_COUNTER_PERIODS + 0.5) * longest)

    # --- sampling --------------------------------------------------------------------------------
    def _run(self, generation: int) -> None:
        while not self._stop.is_set() and generation == self._generation:
            self._wake.clear()
            self.sample_once(generation=generation)
            self._wake.wait(self.interval_s)

    def _watch(self) -> None:
        """Declare a read hung past :data:`READ_TIMEOUT_S` and hand the other sensors to a fresh thread."""
        while not self._stop.wait(READ_TIMEOUT_S / 4):
            reading = self._reading
            if reading is None:
                continue
            generation, series, started = reading
            if generation != self._generation or time.perf_counter() - started < READ_TIMEOUT_S:
                continue
            with self._lock:
                if generation != self._generation:
                    continue
                self.hung.add(series.name)
                self._fail(series, f"read did not return within {READ_TIMEOUT_S:g} s (hung)", series.last_time_s
                           if series.last_time_s is not None else self.clock())
                self._generation += 1
                self._reading = None
                for meter in self._meters:
                    meter.resolve(self.series)
            if not self._stop.is_set():
                self._start_thread()

    def _fail(self, series: SensorSeries, message: str, t: float) -> None:
        series.failure = message
        series.failed_at = t
        self.failures.append(SensorFailure(series.name, message, t))

    def sample_once(self, read_all: bool = False, generation: int | None = None) -> None:
        """One tick: read the sensors that are due, then feed meters and listeners.

        A sensor read less than its ``min_read_interval_s`` ago is skipped this tick unless ``read_all``
        (tests). Reads run without the data lock, each timed by the watchdog.
        """
        generation = self._generation if generation is None else generation
        t = self.clock()
        with self._lock:
            due = [s for s in self.series.values() if s.live and (read_all or not s.read_recently(t))]
        values = []
        for series in due:
            sensor = series.sensor
            self._reading = (generation, series, time.perf_counter())
            try:
                value = sensor.energy_j() if series.kind == "energy" else sensor.power_w()
                fields = sensor.read_fields()
                values.append((series, float(value), fields, None, self.clock()))  # a read can take ms (NVML)
            except Exception as err:  # a broken sensor never stops sampling or training
                values.append((series, math.nan, {}, f"{type(err).__name__}: {err}", None))
            finally:
                self._reading = None
            if generation != self._generation:
                return  # declared hung and replaced meanwhile: discard this tick
        with self._lock:
            if generation != self._generation:
                return
            readings = []
            breakpoints = self._breakpoints(t)
            for series, value, fields, error, read_end in values:
                if error is None:
                    try:
                        shape = getattr(series.sensor, "shape_power_field", None)  # counter + power reading
                        series.add_reading(t, value, breakpoints.get(series.name, ()),
                                           shape_w=fields.get(shape) if shape is not None else None,
                                           read_end_s=read_end)
                        series.fields = fields
                    except Exception as err:  # a non-finite value, a counter going backwards, ...
                        error = f"{type(err).__name__}: {err}"
                if error is not None:
                    self._fail(series, error, t)
                    continue
                energy = series.trace_energy_J  # the counter as read (its points sit at update times)
                readings.append(Reading(series.name, energy, series.power_w, series.fields))
            self.samples_taken += 1
            listeners = list(self._listeners) if readings else []
        # listeners (file writes) run outside the data lock, and before the meters hear of this sample:
        # whatever a resolved mark relies on is in the trace by then
        for listener in listeners:
            try:
                listener(t, readings)
            except Exception as err:  # e.g. a full disk under the trace: drop the listener, go on
                self.remove_listener(listener)
                self.failures.append(SensorFailure(f"listener {listener!r}", f"{type(err).__name__}: {err}", t))
        with self._lock:
            if generation != self._generation:
                return
            for meter in self._meters:
                meter.resolve(self.series)
            self._trim()

    def _breakpoints(self, t: float) -> dict[str, list[float]]:
        """Times (s) up to ``t`` of the marks the meters still wait on, per sensor of each meter: where the
        work, hence the power, changes (``SensorSeries.add_reading``). Under the data lock; a few marks.

        A device mark whose time is not known yet is left out (its interval keeps the midpoint rule).
        """
        out: dict[str, list[float]] = {}
        for meter in self._meters:
            # the training thread appends marks without a lock: copy the deque in one C call (atomic)
            times = [m.t for m in tuple(meter._pending_marks) if m.t is not None and m.t <= t]
            if times:
                for name in meter.sensor_names:
                    out.setdefault(name, []).extend(times)
        return out

    def force_resolve(self, meter: Meter, mark: Mark) -> None:
        """Resolve ``mark`` now from the samples at hand, extrapolating sensors that do not reach it yet.

        Takes only the data lock (never held during a read): safe on the training thread.
        """
        with self._lock:
            meter.resolve(self.series, force_until=mark)

    def energy_at(self, names: list[str], t: float) -> tuple[dict[str, float | None], tuple[str, ...]]:
        """Cumulative J per sensor at time ``t`` from the samples at hand, and the sensors extrapolated.

        Failed sensors are frozen at their last good sample (and listed); no sensor is read.
        """
        energy, flagged = {}, []
        with self._lock:
            for name in names:
                s = self.series.get(name)
                if s is None:
                    energy[name] = None
                elif s.covers(t):
                    energy[name] = s.energy_at(t)
                elif not s.live:
                    energy[name] = s.last_energy_J
                    flagged.append(name)
                else:
                    energy[name] = s.extrapolate(t)
                    flagged.append(name)
        return energy, tuple(flagged)

    def covered_until(self, names: list[str]) -> float:
        """The latest time (s) up to which every live sensor of ``names`` has samples."""
        with self._lock:
            ends = [s.last_time_s for n in names if (s := self.series.get(n)) is not None and s.live]
        return min((e for e in ends if e is not None), default=math.inf) if ends else math.inf

    def _trim(self) -> None:
        oldest = [t for m in self._meters if (t := m.oldest_pending_time()) is not None]
        oldest.extend(self._retained.values())
        horizon = min(oldest) if oldest else math.inf
        for series in self.series.values():
            if len(series.times) > 2 * KEEP_POINTS:
                series.trim_before(horizon, KEEP_POINTS)


_SHARED: Sampler | None = None
_SHARED_LOCK = threading.Lock()


def get_sampler() -> Sampler:
    """The process-wide sampler every callback of this suite shares."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Sampler()
        return _SHARED
