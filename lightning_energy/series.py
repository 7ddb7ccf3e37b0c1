"""Cumulative-energy series of one sensor: the points the sampler keeps and interpolation over them.

Every sensor becomes a list of (time s, cumulative energy J) points. Power sensors add a point per
sample, integrated with the trapezoid rule (exact for constant power). Counters that only advance every
``counter_update_period_s`` keep a point only when the counter moves (or after 1.5 periods without a
move, which means real zero power), so that linear interpolation between points spreads each update
over the interval it covers instead of putting the whole jump into whichever window holds it.
"""

from __future__ import annotations

import bisect
import math

from lightning_energy.sensors.base import Sensor

# A quiet counter still gets a point after this many update periods, so zero power stays resolvable.
STALE_COUNTER_PERIODS = 1.5
READ_SLACK_S = 1e-6  # a tick due exactly at a sensor's read interval still reads it


class SensorSeries:
    """Points of one sensor; touched only under the sampler's lock."""

    def __init__(self, sensor: Sensor) -> None:
        self.sensor = sensor
        self.name = sensor.name
        self.kind = sensor.kind
        self.times: list[float] = []
        self.energies: list[float] = []
        self.power_w = math.nan  # latest power, W (read, or derived from the last two points)
        self.fields: dict[str, float] = {}
        self.failure: str | None = None
        self.failed_at: float | None = None
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

    def add_reading(self, t: float, value: float) -> None:
        """Add one reading taken at time ``t``: joules for counters, watts for power sensors."""
        self._last_read_t = t
        if not math.isfinite(value):
            raise ValueError(f"sensor returned a non-finite value: {value!r}")
        if self.kind == "power":
            if value < 0:
                raise ValueError(f"sensor returned a negative power: {value} W")
            if self.times:
                dt = t - self.times[-1]
                self.energies.append(self.energies[-1] + dt * (self.power_w + value) / 2.0)
            else:
                self.energies.append(0.0)
            self.times.append(t)
            self.power_w = value
            return
        if self._last_read is not None and value < self._last_read:
            raise ValueError(f"energy counter went backwards ({self._last_read} J -> {value} J)")
        self._last_read = value
        if not self.times:
            self.times.append(t)
            self.energies.append(value)
            return
        period = self.sensor.counter_update_period_s
        moved = value != self.energies[-1]
        stale = period is not None and (t - self.times[-1]) >= STALE_COUNTER_PERIODS * period
        if period is None or moved or stale:
            dt = t - self.times[-1]
            self.power_w = (value - self.energies[-1]) / dt if dt > 0 else self.power_w
            self.times.append(t)
            self.energies.append(value)

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
