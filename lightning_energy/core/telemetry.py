"""GPU telemetry as logged figures: time-weighted means over steps and epochs of what the sampling thread
already reads for the trace (utilisation, memory utilisation, SM clock, temperature, performance state).

Never a device call on the training thread: a sampler listener keeps, per sensor and field, the running
time integral of the readings (each value held until the next reading), and a window's mean is the
integral's difference over the window divided by its length, looked up by bisection (a few microseconds per
window). The history is thinned past :data:`RECENT_POINTS` points (older integral points are dropped
two by one), so memory stays bounded over a long run; a window in the thinned part is then averaged over
the kept points around its edges (its mean is exact at the points kept, off by at most one thinned gap's
share at each edge).
"""

from __future__ import annotations

import bisect
import math

from lightning_energy.measure.sampler import Reading

#: reading field -> metric suffix (units in the name; ``pstate``: NVIDIA's P-state, 0 = highest performance)
TELEMETRY_FIELDS = {
    "gpu_util_pct": "gpu_util_pct",
    "mem_util_pct": "mem_util_pct",
    "sm_clock_MHz": "sm_clock_MHz",
    "temperature_C": "temperature_C",
    "pstate": "pstate",
}
RECENT_POINTS = 20_000  # per sensor and field, kept at full resolution


class _FieldHistory:
    """One field of one sensor: reading times (s) and the running integral (value x s) at each."""

    __slots__ = ("points", "last_t", "last_value")

    def __init__(self) -> None:
        self.points: tuple[list[float], list[float]] = ([], [])  # (times, integrals), rebound when thinned
        self.last_t = math.nan
        self.last_value = math.nan

    def add(self, t: float, value: float) -> None:
        """On the sampling thread: a reading ``value`` at ``t`` (non-finite values end the held value)."""
        times, integrals = self.points
        if times and t <= times[-1]:
            return
        integral = integrals[-1] if integrals else 0.0
        if times and math.isfinite(self.last_value):
            integral += self.last_value * (t - self.last_t)
        integrals.append(integral)  # integrals first: a reader bounds its view by len(times)
        times.append(t)
        self.last_t, self.last_value = t, value
        if len(times) > 2 * RECENT_POINTS:
            old = len(times) - RECENT_POINTS
            self.points = (times[:old:2] + times[old:], integrals[:old:2] + integrals[old:])

    def integral_at(self, t: float) -> float | None:
        """The integral up to ``t`` (None: before the first reading)."""
        times, integrals = self.points
        n = len(times)
        if n == 0 or t < times[0]:
            return None
        i = bisect.bisect_right(times, t, 0, n) - 1
        if i + 1 < n:  # between two kept points: the integral is linear between them
            t0, t1 = times[i], times[i + 1]
            return integrals[i] + (integrals[i + 1] - integrals[i]) * (t - t0) / (t1 - t0)
        held = self.last_value if math.isfinite(self.last_value) else 0.0
        return integrals[i] + held * (t - times[i])

    def mean(self, start_s: float, end_s: float, excluded: list[tuple[float, float]] = ()) -> float:
        """The time-weighted mean over ``[start_s, end_s]`` less the ``excluded`` intervals inside it (nan:
        no reading before the window's start, or nothing left)."""
        total, seconds = 0.0, 0.0
        for sign, (a_s, b_s) in [(1.0, (start_s, end_s)), *((-1.0, part) for part in excluded)]:
            a, b = self.integral_at(a_s), self.integral_at(b_s)
            if a is None or b is None:
                return math.nan
            total += sign * (b - a)
            seconds += sign * (b_s - a_s)
        return total / seconds if seconds > 0 else math.nan


class TelemetryRecorder:
    """A sampler listener keeping the telemetry of ``sensor_names`` for window means."""

    def __init__(self, sensor_names: list[str], fields: dict[str, str] | None = None) -> None:
        self.sensor_names = set(sensor_names)
        self.fields = dict(TELEMETRY_FIELDS if fields is None else fields)
        self.history: dict[tuple[str, str], _FieldHistory] = {}

    def __call__(self, t: float, readings: list[Reading]) -> None:
        for reading in readings:
            if reading.name not in self.sensor_names or not reading.fields:
                continue
            at = reading.t_s if math.isfinite(reading.t_s) else t
            for field in self.fields:
                value = reading.fields.get(field)
                if value is None:
                    continue
                key = (reading.name, field)
                history = self.history.get(key)
                if history is None:
                    history = self.history[key] = _FieldHistory()
                history.add(at, float(value))

    def means(self, start_s: float, end_s: float, excluded: list[tuple[float, float]] = ()) -> dict[str, dict[str, float]]:
        """sensor -> field -> time-weighted mean over the window less ``excluded`` (fields with no reading
        left out)."""
        out: dict[str, dict[str, float]] = {}
        for (sensor, field), history in list(self.history.items()):
            value = history.mean(start_s, end_s, excluded)
            if math.isfinite(value):
                out.setdefault(sensor, {})[field] = value
        return out

    def metrics(self, start_s: float, end_s: float, window: str, prefix: str = "",
                excluded: list[tuple[float, float]] = ()) -> dict[str, float]:
        """``telemetry/<prefix><sensor>/<window>/<field>`` for each mean over the window less ``excluded``
        (``window``: ``step`` or ``epoch``; ``prefix``: ``rank<N>/`` in a distributed run)."""
        return {f"telemetry/{prefix}{_metric_part(sensor)}/{window}/{self.fields[field]}": value
                for sensor, fields in self.means(start_s, end_s, excluded).items() for field, value in fields.items()}


def _metric_part(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name)
