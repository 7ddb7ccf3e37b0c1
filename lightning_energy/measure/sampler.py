"""The background sampling of a process, shared by every callback of this suite.

Callbacks :meth:`Sampler.acquire` it with their sensors in ``setup`` and :meth:`Sampler.release` it in
``teardown``; the sampling thread runs while anyone holds it. Each tick reads every sensor that is due
(each at most once per its ``min_read_interval_s``), appends to the bounded per-sensor series, lets the
meters resolve their marks and hands the readings to listeners (the trace writer), once per tick.

Times. Every reading is stamped with the time its own read began (``Reading.t_s``): a sensor read after
a slow one is not stamped early. Its read end is taken just after the value is read, before the sensor's
telemetry (``read_fields``, which may block for tens of ms: NVML's PCIe queries); for a counter shaped by a
power reading among its telemetry (``shape_power_field``), after the telemetry when that held no slow
query (:data:`FAST_TELEMETRY_S`), so that the end covers the power reading too. Device marks
(CUDA events) whose boundary the device has reached are given their time before a tick's readings are
added, so the series see them as boundaries (the boundary rule of :mod:`lightning_energy.measure.series`).

Slow sensors. A sensor whose read (value and telemetry) takes longer than :data:`SLOW_READ_FRACTION` of
the sampling interval would delay every sensor read after it: from then on it is read on a reader thread
of its own (``lightning-energy-reader-<name>``), which queues its readings, each with its own times, for
the sampling thread to add at its next tick. Only the sampling thread adds readings to the series, so
listeners still see every reading before a mark that relies on it resolves.

Errors. A read that raises (or returns a value the series refuses) is a transient error: recorded in
:attr:`Sampler.read_errors` (counted per sensor in :attr:`Sampler.read_error_counts`) and skipped; the
sensor is failed (frozen at its last good sample, listed in :attr:`Sampler.failures`) only past its error
budget: :data:`READ_ERROR_STREAK_LIMIT` failed reads in a row, or more than :data:`READ_ERROR_WINDOW_LIMIT`
of its last :data:`READ_ERROR_WINDOW_READS`. Any other error on the sampling thread (a meter whose clock
raises, a listener, a bug) is recorded in :attr:`Sampler.failures` under the name of what raised and the
thread goes on; one meter's error does not stop the others.

Locks: the data lock guards the series, meters and listeners and is held only for bookkeeping, never
while a sensor is read or a listener writes; so the training thread, which never reads a sensor, never
waits behind a slow read either. A read that does not return within :data:`READ_TIMEOUT_S` is declared
hung by a watchdog (per sensor, on whichever thread it is read): the sensor is flagged failed (its energy
up to its last good sample stays counted); if it was read on the sampling thread, a fresh sampling thread
takes over the other sensors. A stuck thread is abandoned and discards whatever its read returns. A
forced resolution (a wait that ran out, the fit's end) that finds a read in flight for longer than the
resolution bound (and :data:`LATE_READ_MIN_S`) declares that sensor hung at once rather than extrapolating
it silently.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from lightning_energy.measure.meter import Mark, Meter
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.series import READ_SLACK_S, STALE_COUNTER_PERIODS, SensorSeries

# 20 Hz: twice the ~10 Hz update rate of NVML's energy counter; each tick costs ~75 us of CPU holding the GIL.
DEFAULT_INTERVAL_S = 0.05
MIN_INTERVAL_S = 0.001
KEEP_POINTS = 4096  # per sensor, beyond what pending marks and retained windows still need
# Longest a mark waits for samples before it is extrapolated: a few sampling intervals plus the counter's
# staleness rule, capped (a sensor slower than this is extrapolated and flagged instead of stalling).
RESOLUTION_INTERVALS = 3
MAX_RESOLUTION_WAIT_S = 1.0
SETUP_WAIT_S = 1.0  # bound of the once-per-fit wait for every new sensor's first sample (s)
# A sensor's open() longer than this (s) is declared hung and the sensor left out: far beyond any healthy open
# (nvmlInit on an 8-GPU node: ~1-2 s; a BMC session: a few s), short enough not to stall a fit's set-up for long.
OPEN_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 2.0  # a single sensor read longer than this is declared hung
WATCHDOG_POLLS_PER_TIMEOUT = 4  # the watchdog looks every READ_TIMEOUT_S / 4
# A forced resolution declares hung a read in flight for longer than the resolution bound, and at least this
# long (s): far beyond any healthy read (NVML with its PCIe telemetry: ~45 ms), and beyond what scheduling on
# a loaded machine adds to one, so a healthy sensor is never failed for a hiccup.
LATE_READ_MIN_S = 0.5
# ... and for a sensor slow by nature (its remembered read time, a BMC's second), longer than this many of its
# usual reads: only the watchdog (READ_TIMEOUT_S) declares such a read hung sooner.
SLOW_READ_HUNG_FACTOR = 3.0
THREAD_JOIN_TIMEOUT_S = 5.0
READ_DONE_POLL_S = 0.001  # how often release looks whether a read in flight of a sensor to close returned (s)
# A read (value and telemetry) longer than this fraction of the sampling interval delays the sensors read
# after it in a tick by more than that: the sensor is moved to a reader thread of its own. Reads shorter
# than SLOW_READ_MIN_S never are (NVML's counter: 2.4 ms), however short the interval.
SLOW_READ_FRACTION = 0.25
SLOW_READ_MIN_S = 0.005
# Telemetry that returns within this (s) held no slow query (NVML's are 1-8 us each, its PCIe ones ~20 ms).
FAST_TELEMETRY_S = 0.001
# How fast the remembered read time of a slow sensor forgets a long read: each read keeps
# max(its own time, this fraction of the remembered one) (the resolution bound waits for it).
SLOW_READ_MEMORY = 0.9
# Error budget of a sensor (NVML answers TIMEOUT or UNKNOWN now and then under load): it fails after
# READ_ERROR_STREAK_LIMIT failed reads in a row (0.25 s at 20 Hz) or more than READ_ERROR_WINDOW_LIMIT
# failed reads among its last READ_ERROR_WINDOW_READS (figures with one reading in five missing are not
# worth keeping); any fewer are transient: recorded, counted and skipped.
READ_ERROR_STREAK_LIMIT = 5
READ_ERROR_WINDOW_READS = 100
READ_ERROR_WINDOW_LIMIT = 20
READ_ERRORS_KEPT = 1000  # transient read errors kept in Sampler.read_errors (all are counted)
ERRORS_KEPT_PER_SOURCE = 10  # records in Sampler.failures per failing meter, listener or thread (all counted)
SAMPLING_THREAD = "sampling thread"
WATCHDOG_THREAD = "watchdog thread"


@dataclass(frozen=True)
class Reading:
    """One sensor's values at one read: cumulative J, power W, extra telemetry, and ``t_s``, when the
    read began (s, sampler clock; a listener's ``t`` is its tick's start, at or after a slow sensor's)."""

    name: str
    energy_J: float
    power_W: float
    fields: dict
    t_s: float = math.nan


@dataclass(frozen=True)
class SensorFailure:
    """A failure at time ``t`` (s, sampler clock) of ``name``: a sensor, or a meter, listener or thread."""

    name: str
    message: str
    t: float


@dataclass
class _Read:
    """What one read of a sensor returned: the value (J or W) read from ``t_s`` to ``read_end_s`` (s,
    sampler clock), then the telemetry ``fields``; ``error`` if it raised; ``duration_s`` all included."""

    series: SensorSeries
    t_s: float
    value: float = math.nan
    read_end_s: float | None = None
    fields_from_s: float | None = None  # when the telemetry began to be read (s): after the value
    fields: dict = field(default_factory=dict)
    error: str | None = None
    fields_error: str | None = None
    duration_s: float = 0.0


@dataclass(frozen=True)
class _InFlight:
    """A read under way: who reads (``("tick", generation)`` on the sampling thread, or the sensor's
    :class:`_Reader`), since when (s, sampler clock), on which thread."""

    reader: object
    started_s: float
    thread: threading.Thread


class _Reader:
    """The reader thread of one slow sensor; ``retired`` once stopped or abandoned (a hung read)."""

    def __init__(self, series: SensorSeries) -> None:
        self.series = series
        self.wake = threading.Event()
        self.retired = False
        self.thread: threading.Thread | None = None

    def retire(self) -> None:
        self.retired = True
        self.wake.set()


class _ErrorBudget:
    """The recent read outcomes of one sensor (see :data:`READ_ERROR_STREAK_LIMIT`)."""

    def __init__(self) -> None:
        self.streak = 0
        self.streak_started_s: float | None = None
        self.recent: deque[bool] = deque(maxlen=READ_ERROR_WINDOW_READS)  # True: the read failed

    def succeeded(self) -> None:
        self.recent.append(False)
        self.streak, self.streak_started_s = 0, None

    def failed(self, t: float) -> str | None:
        """Count a failed read at ``t``; the reason to fail the sensor once the budget is spent, else None."""
        self.recent.append(True)
        self.streak += 1
        if self.streak_started_s is None:
            self.streak_started_s = t
        if self.streak >= READ_ERROR_STREAK_LIMIT:
            return f"{self.streak} reads in a row failed"
        errors = sum(self.recent)
        if errors > READ_ERROR_WINDOW_LIMIT:
            return f"{errors} of its last {len(self.recent)} reads failed"
        return None


class Sampler:
    """Background sampler; use :func:`get_sampler` for the process-wide instance.

    Records: :attr:`failures` (failed sensors, and meters, listeners or threads that raised, by name),
    :attr:`open_failures`, :attr:`read_errors` / :attr:`read_error_counts` (transient read errors),
    :attr:`error_counts` (errors per meter, listener or thread), :attr:`hung`, :attr:`slow_sensors`.
    """

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
        self.read_errors: deque[SensorFailure] = deque(maxlen=READ_ERRORS_KEPT)  # transient, not failures
        self.read_error_counts: dict[str, int] = {}  # sensor name -> transient read errors so far
        self.error_counts: dict[str, int] = {}  # meter, listener or thread -> errors so far
        self.slow_sensors: dict[str, float] = {}  # sensor read on its own thread -> its read time (s)
        self.interval_s = DEFAULT_INTERVAL_S
        self.samples_taken = 0
        self._lock = threading.RLock()  # the data lock: never held during a sensor read
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._generation = 0  # bumped when a hung thread is replaced; the old one then discards its work
        self._in_flight: dict[str, _InFlight] = {}  # sensor name -> its read under way
        self._budgets: dict[str, _ErrorBudget] = {}
        self._readers: dict[str, _Reader] = {}  # slow sensors: their reader threads
        self._queued_reads: deque[_Read] = deque()  # read by reader threads, added at the next tick
        self.hung: set[str] = set()  # sensors whose read never returned: never read again, never closed (forgotten at release)

    # --- life cycle -----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def acquire(self, owner: object, sensors: list[Sensor], interval_s: float = DEFAULT_INTERVAL_S,
                start_thread: bool = True) -> list[str]:
        """Register ``owner``'s sensors (opened here) and start the thread; returns the names in use.

        A sensor whose ``open()`` raises, or does not return within :data:`OPEN_TIMEOUT_S` (a driver call that
        hangs), is dropped with one line in :attr:`open_failures` (and left out of the names returned); training
        goes on without it (a hung one is abandoned: never read, never closed). Sensors are opened outside the
        data lock, so sampling goes on meanwhile. Without the thread (``start_thread=False``, tests driving
        :meth:`sample_once` by hand) the sensors are read once here.
        """
        if not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"interval_s must be >= {MIN_INTERVAL_S} s, got {interval_s}")
        with self._lock:
            for sensor in sensors:
                self._check_name_is_free(sensor)
            to_open = [s for s in sensors if s.name not in self.series]
        failed = {sensor.name for sensor in to_open if not self._open_bounded(sensor)}
        with self._lock:
            self._owners[owner] = interval_s
            self.interval_s = min(self._owners.values())
            names = []
            for sensor in sensors:
                if sensor.name in failed:
                    continue
                if sensor.name not in self.series:
                    self.series[sensor.name] = SensorSeries(sensor)
                    self._budgets[sensor.name] = _ErrorBudget()
                self._users.setdefault(sensor.name, set()).add(owner)
                names.append(sensor.name)
        if not start_thread:
            self.sample_once()
            return names
        if not self.running:
            with self._lock:
                self._stop.clear()
                self._start_thread()
        self._wake.set()
        self._await_first_points(names)
        return names

    def _open_bounded(self, sensor: Sensor) -> bool:
        """Open ``sensor`` on a thread of its own, waiting at most :data:`OPEN_TIMEOUT_S`; False (and one line in
        :attr:`open_failures`) if it raised or did not return."""
        outcome: list[BaseException | None] = []

        def open_it() -> None:
            try:
                sensor.open()
                outcome.append(None)
            except Exception as err:  # an unusable sensor is dropped, never fatal
                outcome.append(err)

        opener = threading.Thread(target=open_it, name=f"lightning-energy-open-{sensor.name}", daemon=True)
        opener.start()
        opener.join(OPEN_TIMEOUT_S)
        if not outcome:
            problem = f"open() did not return within {OPEN_TIMEOUT_S:g} s (hung; abandoned, never closed)"
        elif outcome[0] is not None:
            problem = f"{type(outcome[0]).__name__}: {outcome[0]}"
        else:
            return True
        with self._lock:
            self.open_failures.append(
                f"sensor {sensor.name!r} ({sensor.source}) could not be opened and is not measured: {problem}")
        return False

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
        """Start the sampling thread (and the watchdog if none runs): from ``acquire`` (which clears the stop
        flag first) or, under the data lock, as a hung thread's replacement (never after ``stop``)."""
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
        """Drop ``owner``; close sensors nobody uses any more; stop the threads when nobody is left."""
        to_close, readers = [], []
        with self._lock:
            self._owners.pop(owner, None)
            self._retained.pop(owner, None)
            for name in [n for n, users in self._users.items() if owner in users]:
                users = self._users[name]
                users.discard(owner)
                if not users:
                    del self._users[name]
                    to_close.append(self.series.pop(name))
                    self._budgets.pop(name, None)
                    self.slow_sensors.pop(name, None)
                    if (reader := self._readers.pop(name, None)) is not None:
                        reader.retire()
                        readers.append(reader)
            if self._owners:
                self.interval_s = min(self._owners.values())
            else:
                self.failures.clear()
                self.open_failures.clear()
                self.read_errors.clear()
                self.read_error_counts.clear()
                self.error_counts.clear()
        for reader in readers:  # before its sensor is closed under it
            self._join(reader.thread)
        for series in to_close:
            if series.name in self.hung or not self._await_read_done(series.name):
                # stuck in a read (closing would block too, or run under it): left unclosed; its name is free
                # again for a later fit's sensor, whose reads have nothing to do with this one's
                self.hung.discard(series.name)
                continue
            try:
                series.sensor.close()
            except Exception:  # closing a broken sensor must not break teardown
                pass
        if not self._owners:
            self.stop()

    def stop(self) -> None:
        """Stop and join (bounded) the sampling thread, the slow sensors' readers and the watchdog.

        A thread with a read in flight is waited for until that read would be declared hung at most; a
        thread stuck in a hung read is left behind (it discards what its read returns)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._generation += 1  # a thread that outlives its join discards its tick and ends
            readers = list(self._readers.values())
            self._readers.clear()
            self._queued_reads.clear()
        for reader in readers:
            reader.retire()
        thread, self._thread = self._thread, None
        watchdog, self._watchdog = self._watchdog, None
        for joined in [thread, *(r.thread for r in readers), watchdog]:
            self._join(joined)

    def _await_read_done(self, name: str) -> bool:
        """Wait (bounded: until the read would be declared hung) for a read of ``name`` in flight on any thread
        to return; False if it is still in flight."""
        read = self._in_flight.get(name)
        if read is None:
            return True
        deadline = time.perf_counter() + max(READ_TIMEOUT_S - (self.clock() - read.started_s), 0.0)
        while self._in_flight.get(name) is read and time.perf_counter() < deadline:
            time.sleep(READ_DONE_POLL_S)
        return self._in_flight.get(name) is not read

    def _join(self, thread: threading.Thread | None) -> None:
        if thread is None or thread is threading.current_thread():
            return
        timeout_s = THREAD_JOIN_TIMEOUT_S
        now = self.clock()
        for name, read in tuple(self._in_flight.items()):
            if read.thread is thread:
                timeout_s = 0.0 if name in self.hung else max(READ_TIMEOUT_S - (now - read.started_s), 0.0)
        thread.join(timeout=timeout_s)

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
        """Ask the threads for a read now rather than at the next interval (sensors still read when due)."""
        self._wake.set()
        for reader in tuple(self._readers.values()):
            reader.wake.set()

    def resolution_timeout_s(self) -> float:
        """How long a wait for a mark may take before it is extrapolated (s): a few sampling intervals plus
        the staleness rule over the slowest sensor (its counter period, read interval or read time)."""
        periods = [max(s.sensor.counter_update_period_s or 0.0, s.sensor.min_read_interval_s or 0.0,
                       self.slow_sensors.get(s.name, 0.0))
                   for s in list(self.series.values())]
        longest = max([self.interval_s, *periods])
        return min(MAX_RESOLUTION_WAIT_S, RESOLUTION_INTERVALS * self.interval_s + (STALE_COUNTER_PERIODS + 0.5) * longest)

    # --- errors ----------------------------------------------------------------------------------
    def _fail(self, series: SensorSeries, message: str, t: float) -> None:
        series.failure = message
        series.failed_at = t
        self.failures.append(SensorFailure(series.name, message, t))

    def _record_error(self, source: str, err: BaseException, t: float) -> None:
        """An error of a meter, listener or thread (not a sensor read): counted, and recorded in
        :attr:`failures` under ``source`` (the first :data:`ERRORS_KEPT_PER_SOURCE` of each source)."""
        count = self.error_counts[source] = self.error_counts.get(source, 0) + 1
        if count <= ERRORS_KEPT_PER_SOURCE:
            self.failures.append(SensorFailure(source, f"{type(err).__name__}: {err}", t))

    def _read_failed(self, series: SensorSeries, message: str, t: float) -> None:
        """A read of ``series`` failed at ``t`` (data lock held): recorded, and past the sensor's error
        budget the sensor is failed (from the first error of its streak)."""
        self.read_errors.append(SensorFailure(series.name, message, t))
        self.read_error_counts[series.name] = self.read_error_counts.get(series.name, 0) + 1
        budget = self._budgets.setdefault(series.name, _ErrorBudget())
        reason = budget.failed(t)
        if reason is not None:
            started = budget.streak_started_s if budget.streak_started_s is not None else t
            self._fail(series, f"{reason}; the last: {message}", started)

    # --- sampling --------------------------------------------------------------------------------
    def _run(self, generation: int) -> None:
        while not self._stop.is_set() and generation == self._generation:
            self._wake.clear()
            try:
                self.sample_once(generation=generation, detach_slow=True)
            except Exception as err:  # the thread survives anything: recorded, and the next tick comes
                self._record_error(SAMPLING_THREAD, err, self.clock())
            self._wake.wait(self.interval_s)

    def _watch(self) -> None:
        """Declare a read hung past :data:`READ_TIMEOUT_S`, whichever thread reads it."""
        while not self._stop.wait(READ_TIMEOUT_S / WATCHDOG_POLLS_PER_TIMEOUT):
            try:
                self._declare_hung(READ_TIMEOUT_S, f"read did not return within {READ_TIMEOUT_S:g} s (hung)")
            except Exception as err:  # the watchdog survives anything too
                self._record_error(WATCHDOG_THREAD, err, self.clock())

    def _declare_hung(self, older_than_s: float, message: str, names: list[str] | None = None) -> None:
        """Fail every sensor (of ``names``) whose read has been in flight for ``older_than_s`` (s) or more.

        Its reader is abandoned: a reader thread retires, the sampling thread is replaced by a fresh one
        (the old one discards its tick when its read returns). Then the meters resolve what that frees.
        """
        now = self.clock()
        declared = restart = False
        with self._lock:
            for name, read in tuple(self._in_flight.items()):
                series = self.series.get(name)
                # a sensor slow by nature (a BMC read of a second) is not hung at a forced resolution until its
                # read has taken several of its usual reads
                limit = older_than_s if names is None else max(
                    older_than_s, SLOW_READ_HUNG_FACTOR * self.slow_sensors.get(name, 0.0))
                if (names is not None and name not in names) or now - read.started_s < limit:
                    continue
                if self._in_flight.get(name) is not read:
                    continue  # the read returned meanwhile
                del self._in_flight[name]
                if series is None or not series.live:
                    continue
                self.hung.add(name)
                self._fail(series, message, series.last_time_s if series.last_time_s is not None else now)
                declared = True
                if isinstance(read.reader, _Reader):
                    read.reader.retire()
                    self._readers.pop(name, None)
                elif read.reader == ("tick", self._generation):
                    self._generation += 1
                    restart = self._thread is not None and not self._stop.is_set()
            if declared:
                self._resolve_meters(now)
            if restart and not self._stop.is_set():  # under the lock: stop() cannot slip in between
                self._start_thread()

    def sample_once(self, read_all: bool = False, generation: int | None = None, detach_slow: bool = False) -> None:
        """One tick: read the sensors that are due, then feed meters and listeners.

        A sensor read less than its ``min_read_interval_s`` ago is skipped this tick unless ``read_all``
        (tests). Reads run without the data lock, each timed by the watchdog. ``detach_slow`` (the sampling
        thread): a sensor whose read took longer than :data:`SLOW_READ_FRACTION` of the interval goes to a
        reader thread of its own. The readings those threads queued are added here too.
        """
        generation = self._generation if generation is None else generation
        t = self.clock()
        with self._lock:
            due = [s for s in self.series.values()
                   if s.live and s.name not in self._readers and (read_all or not s.read_recently(t))]
        reads = []
        for series in due:
            if not series.live or self.series.get(series.name) is not series:
                continue  # released (its sensor about to be closed) or failed since the tick began
            read = self._read(series, ("tick", generation))
            if generation != self._generation:
                return  # declared hung and replaced meanwhile: discard this tick
            reads.append(read)
            # one slow read is enough: waiting for a second could leave the others behind a read that hangs
            if detach_slow and read.duration_s > max(SLOW_READ_FRACTION * self.interval_s, SLOW_READ_MIN_S):
                self._read_alone_from_now_on(series, read.duration_s)
        with self._lock:
            if generation != self._generation:
                return
            while self._queued_reads:
                reads.append(self._queued_reads.popleft())
            self._learn_device_times(t)
            readings = [r for read in reads if (r := self._add(read, t)) is not None]
            self.samples_taken += 1
            listeners = list(self._listeners) if readings else []
        # listeners (file writes) run outside the data lock, and before the meters hear of this sample:
        # whatever a resolved mark relies on is in the trace by then
        for listener in listeners:
            try:
                listener(t, readings)
            except Exception as err:  # e.g. a full disk under the trace: drop the listener, go on
                self.remove_listener(listener)
                self._record_error(f"listener {listener!r}", err, t)
        with self._lock:
            if generation != self._generation:
                return
            self._resolve_meters(t)
            self._trim()

    def _read(self, series: SensorSeries, reader: object) -> _Read:
        """Read one sensor, timed: the value, its end, then the telemetry. Never raises."""
        sensor = series.sensor
        read = _Read(series, self.clock())
        in_flight = self._in_flight[series.name] = _InFlight(reader, read.t_s, threading.current_thread())
        try:
            read.value = float(sensor.energy_j() if series.kind == "energy" else sensor.power_w())
            read.read_end_s = read.fields_from_s = self.clock()  # a read can take ms (NVML's counter: 2.4 ms)
            try:
                read.fields = sensor.read_fields()  # may block longer (NVML's PCIe queries: ~20 ms each)
            except Exception as err:  # telemetry lost, the value kept
                read.fields_error = f"telemetry: {type(err).__name__}: {err}"
            fields_end_s = self.clock()
            if getattr(sensor, "shape_power_field", None) is not None and (
                    fields_end_s - read.read_end_s <= FAST_TELEMETRY_S):
                # the power reading the series shapes with is read among the telemetry: when no slow query
                # ran, the read ends after it too (when one did, a few us before it: NVML's fast queries
                # come first, its PCIe ones last)
                read.read_end_s = fields_end_s
        except Exception as err:  # a broken sensor never stops sampling or training
            read.error = f"{type(err).__name__}: {err}"
        finally:
            if self._in_flight.get(series.name) is in_flight:
                del self._in_flight[series.name]
        read.duration_s = self.clock() - read.t_s
        return read

    def _add(self, read: _Read, tick_s: float) -> Reading | None:
        """Add one read to its series (data lock held); the reading for listeners, None if there is none.

        Listeners see one time per tick (``tick_s``, the trace's row time): a power sensor read later in the
        tick gives its cumulative energy at ``tick_s`` (the series' own figure there, final once the reading is
        in), so a row's energies all hold at the row's time; a reading older than the tick (a slow sensor's,
        queued by its reader thread) and counters (their points sit at update times) keep their own."""
        series = read.series
        if not series.live or self.series.get(series.name) is not series:
            return None  # failed (declared hung) or released while it was read
        error = read.error
        if error is None:
            try:
                shape = getattr(series.sensor, "shape_power_field", None)  # counter + power reading
                series.add_reading(read.t_s, read.value, self._breakpoints(read.t_s).get(series.name, ()),
                                   shape_w=read.fields.get(shape) if shape is not None else None,
                                   read_end_s=read.read_end_s, shape_from_s=read.fields_from_s)
                series.fields = read.fields
            except Exception as err:  # a non-finite value, a counter going backwards, ...
                error = f"{type(err).__name__}: {err}"
        if error is not None:
            self._read_failed(series, error, read.t_s)
            return None
        self._budgets.setdefault(series.name, _ErrorBudget()).succeeded()
        if read.fields_error is not None:
            self.read_errors.append(SensorFailure(series.name, read.fields_error, read.t_s))
        energy, at_s = series.trace_energy_J, read.t_s  # a counter as read (its points sit at update times)
        if series.kind == "power" and at_s > tick_s and series.covers(tick_s):
            energy, at_s = series.energy_at(tick_s), tick_s
        return Reading(series.name, energy, series.power_w, series.fields, at_s)

    def _read_alone_from_now_on(self, series: SensorSeries, read_s: float) -> None:
        """Give a slow sensor a reader thread of its own (once; it keeps it until released or failed)."""
        with self._lock:
            if series.name in self._readers or not series.live or self.series.get(series.name) is not series:
                return
            reader = self._readers[series.name] = _Reader(series)
            self.slow_sensors[series.name] = read_s
        reader.thread = threading.Thread(target=self._read_alone, args=(reader,),
                                         name=f"lightning-energy-reader-{series.name}", daemon=True)
        reader.thread.start()

    def _read_alone(self, reader: _Reader) -> None:
        """A slow sensor's reader thread: read it every interval (at most once per its minimum read interval)
        and queue each read for the sampling thread's next tick."""
        series = reader.series
        last_read_s = -math.inf
        while not reader.retired and series.live:
            reader.wake.clear()
            min_interval_s = series.sensor.min_read_interval_s or 0.0
            if self.clock() - last_read_s >= min_interval_s - READ_SLACK_S:
                read = self._read(series, reader)  # never raises
                last_read_s = read.t_s
                if reader.retired:
                    return  # stopped, released or declared hung meanwhile: discard the read
                remembered = self.slow_sensors.get(series.name, 0.0)
                self.slow_sensors[series.name] = max(read.duration_s, SLOW_READ_MEMORY * remembered)
                self._queued_reads.append(read)
            reader.wake.wait(self.interval_s)

    def _learn_device_times(self, t: float) -> None:
        """Give pending device marks the device has reached their times (never blocks; data lock held), so
        that the readings about to be added see them as boundaries. One meter's error spares the others."""
        for meter in list(self._meters):
            try:
                meter.resolve_device_times()
            except Exception as err:
                self._record_error(repr(meter), err, t)

    def _resolve_meters(self, t: float) -> None:
        """Let every meter resolve what the samples cover (data lock held); errors are recorded per meter."""
        for meter in list(self._meters):
            try:
                meter.resolve(self.series)
            except Exception as err:
                self._record_error(repr(meter), err, t)

    def _breakpoints(self, t: float) -> dict[str, list[float]]:
        """Times (s) up to ``t`` of the marks the meters still wait on, per sensor of each meter: where the
        work, hence the power, changes (``SensorSeries.add_reading``). Under the data lock; a few marks.

        A device mark whose time is not known yet is left out (its interval keeps the midpoint rule); each
        tick first learns the times of those the device has reached (:meth:`_learn_device_times`).
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

        A sensor of ``meter`` whose read has been in flight for longer than :meth:`resolution_timeout_s`
        (and :data:`LATE_READ_MIN_S`) is declared hung first (failed, frozen at its last good sample,
        flagged) rather than extrapolated as if it were merely late. Takes only the data lock (never held
        during a read): safe on the training thread.
        """
        late_s = max(self.resolution_timeout_s(), LATE_READ_MIN_S)
        self._declare_hung(late_s, f"read did not return within {late_s:.2f} s or {SLOW_READ_HUNG_FACTOR:g} of its "
                           "usual reads (hung; found by a forced resolution)", names=meter.sensor_names)
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
