"""The one background sampling thread of a process, shared by every callback of this suite.

Callbacks :meth:`Sampler.acquire` it with their sensors in ``setup`` and :meth:`Sampler.release` it in
``teardown``; the thread runs while anyone holds it. Each tick reads every sensor once, appends to the
bounded per-sensor series, hands the readings to listeners (the trace writer) and lets the meters
resolve their marks. The training thread never takes the sampler's lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from lightning_energy.meter import Mark, Meter
from lightning_energy.sensors.base import Sensor
from lightning_energy.series import STALE_COUNTER_PERIODS, SensorSeries

# 20 Hz: twice the ~10 Hz update rate of NVML's energy counter; each tick costs ~75 us of CPU holding the GIL.
DEFAULT_INTERVAL_S = 0.05
MIN_INTERVAL_S = 0.001
KEEP_POINTS = 4096  # per sensor, beyond what pending marks still need
MAX_RESOLUTION_WAIT_S = 1.0


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
        self._meters: list[Meter] = []
        self._listeners: list[Callable[[float, list[Reading]], None]] = []
        self.failures: deque[SensorFailure] = deque()
        self.interval_s = DEFAULT_INTERVAL_S
        self.samples_taken = 0
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- life cycle -----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def acquire(self, owner: object, sensors: list[Sensor], interval_s: float = DEFAULT_INTERVAL_S,
                start_thread: bool = True) -> list[str]:
        """Register ``owner``'s sensors (opened here) and start the thread; returns the names in use."""
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
                    sensor.open()
                    self.series[sensor.name] = SensorSeries(sensor)
                self._users.setdefault(sensor.name, set()).add(owner)
                names.append(sensor.name)
            self.sample_once()
        if start_thread and not self.running:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="lightning-energy-sampler", daemon=True)
            self._thread.start()
        return names

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
        with self._lock:
            self._owners.pop(owner, None)
            for name in [n for n, users in self._users.items() if owner in users]:
                users = self._users[name]
                users.discard(owner)
                if not users:
                    del self._users[name]
                    series = self.series.pop(name)
                    try:
                        series.sensor.close()
                    except Exception:  # closing a broken sensor must not break teardown
                        pass
            if self._owners:
                self.interval_s = min(self._owners.values())
                return
            self.failures.clear()
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

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

    def request_sample(self) -> None:
        """Ask the thread for a sample now rather than at the next tick."""
        self._wake.set()

    def resolution_timeout_s(self) -> float:
        """How long a wait for a mark may take before it is extrapolated."""
        periods = [s.sensor.counter_update_period_s or 0.0 for s in self.series.values()]
        longest = max([self.interval_s, *periods])
        return min(MAX_RESOLUTION_WAIT_S, 3 * self.interval_s + (STALE_COUNTER_PERIODS + 0.5) * longest)

    # --- sampling --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            requested = self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self.sample_once(read_all=requested)

    def sample_once(self, read_all: bool = True) -> None:
        """Read the sensors, then feed listeners and meters (sampling thread, or tests).

        Unless ``read_all``, a sensor read less than its ``min_read_interval_s`` ago is skipped this tick.
        """
        with self._lock:
            t = self.clock()
            readings = []
            for series in self.series.values():
                if not series.live or (not read_all and series.read_recently(t)):
                    continue
                try:
                    sensor = series.sensor
                    value = sensor.energy_j() if series.kind == "energy" else sensor.power_w()
                    series.add_reading(t, float(value))
                    series.fields = sensor.read_fields()
                except Exception as err:  # a broken sensor never stops sampling or training
                    series.failure = f"{type(err).__name__}: {err}"
                    series.failed_at = t
                    self.failures.append(SensorFailure(series.name, series.failure, t))
                    continue
                energy = series.energies[-1] if series.times[-1] == t else math.nan
                readings.append(Reading(series.name, energy, series.power_w, series.fields))
            self.samples_taken += 1
            for listener in list(self._listeners) if readings else ():
                try:
                    listener(t, readings)
                except Exception as err:  # e.g. a full disk under the trace: drop the listener, go on
                    self._listeners.remove(listener)
                    self.failures.append(SensorFailure(f"listener {listener!r}", f"{type(err).__name__}: {err}", t))
            for meter in self._meters:
                meter.resolve(self.series)
            self._trim()

    def force_resolve(self, meter: Meter, mark: Mark) -> None:
        """Resolve ``mark`` now, extrapolating sensors whose samples do not reach it yet."""
        with self._lock:
            meter.resolve(self.series, force_until=mark)

    def _trim(self) -> None:
        oldest = [t for m in self._meters if (t := m.oldest_pending_time()) is not None]
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
