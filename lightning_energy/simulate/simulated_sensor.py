"""Simulated sensors with a programmable power trace, for tests and dry runs.

The trace is piecewise constant: ``[(t0_s, watts0), (t1_s, watts1), ...]`` with times relative to the
moment the sensor is opened, or a single constant wattage. Energies are exact integrals of the trace.
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Callable, Sequence

from lightning_energy.provenance import ESTIMATED, SIMULATED
from lightning_energy.measure.sensors.base import Scope, Sensor

PowerTrace = float | Sequence[tuple[float, float]]


class _Trace:
    """Piecewise-constant power P(t) and its exact integral E(t) (t in s from the origin, P in W)."""

    def __init__(self, trace: PowerTrace) -> None:
        if isinstance(trace, (int, float)):
            trace = [(0.0, float(trace))]
        points = [(float(t), float(p)) for t, p in trace]
        if not points or points[0][0] != 0.0:
            raise ValueError("power trace must start at t=0 s, e.g. [(0.0, 100.0), (5.0, 250.0)]")
        if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
            raise ValueError("power trace times must be strictly increasing")
        if any(p < 0 or not math.isfinite(p) for _, p in points):
            raise ValueError("power trace wattages must be finite and non-negative")
        self.starts = [t for t, _ in points]
        self.watts = [p for _, p in points]
        self.energy_at_start = [0.0]
        for i in range(1, len(points)):
            span = self.starts[i] - self.starts[i - 1]
            self.energy_at_start.append(self.energy_at_start[-1] + span * self.watts[i - 1])

    def power(self, t: float) -> float:
        i = max(bisect.bisect_right(self.starts, t) - 1, 0)
        return self.watts[i]

    def energy(self, t: float) -> float:
        if t <= 0:
            return 0.0
        i = bisect.bisect_right(self.starts, t) - 1
        return self.energy_at_start[i] + (t - self.starts[i]) * self.watts[i]


class SimulatedSensor(Sensor):
    """A sensor that follows a known power trace.

    Args:
        name: sensor name.
        trace: constant watts or piecewise-constant ``[(t_s, watts), ...]`` from the moment of ``open()``.
        scope: ``"device"`` or ``"host"``.
        kind: ``"power"`` (reports instantaneous W) or ``"energy"`` (reports the cumulative J counter).
        counter_update_period_s: for ``kind="energy"``, the counter only advances at multiples of
            this period (like NVML's ~0.1 s), to exercise interpolation. ``None``: always exact.
        fail_after_s: raise ``RuntimeError`` on every read later than this many seconds after open.
        clock: time source in seconds (``time.perf_counter`` by default; tests inject a fake).
    """

    def __init__(
        self,
        name: str = "simulated",
        trace: PowerTrace = 100.0,
        scope: Scope = "device",
        kind: str = "power",
        counter_update_period_s: float | None = None,
        fail_after_s: float | None = None,
        estimated: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(name, scope, source=f"simulated power trace ({kind})")
        if kind not in ("power", "energy"):
            raise ValueError(f"`kind` must be 'power' or 'energy', got {kind!r}")
        if counter_update_period_s is not None and counter_update_period_s <= 0:
            raise ValueError(f"`counter_update_period_s` must be > 0, got {counter_update_period_s}")
        self._trace = _Trace(trace)
        self._kind = kind
        self.counter_update_period_s = counter_update_period_s if kind == "energy" else None
        self.fail_after_s = fail_after_s
        self.estimated = estimated
        self._clock = clock
        self._origin: float | None = None

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def provenance(self) -> str:
        """``"simulated"``: its joules follow a programmed trace; ``"estimated"`` when it stands in for an
        estimate (``estimated=True``)."""
        return ESTIMATED if self.estimated else SIMULATED

    def identity(self) -> tuple:
        trace = (tuple(self._trace.starts), tuple(self._trace.watts))
        return (*super().identity(), trace, self.counter_update_period_s, self.fail_after_s)

    def open(self) -> None:
        if self._origin is None:
            self._origin = self._clock()

    def elapsed_s(self) -> float:
        """Seconds since the sensor was opened (opens it on first use)."""
        self.open()
        elapsed = self._clock() - self._origin
        if self.fail_after_s is not None and elapsed > self.fail_after_s:
            raise RuntimeError(f"simulated failure of sensor {self.name!r} after {self.fail_after_s} s")
        return elapsed

    def energy_at(self, t_s: float) -> float:
        """Exact energy in J from open to ``t_s`` seconds after open."""
        return self._trace.energy(t_s)

    def energy_j(self) -> float:
        elapsed = self.elapsed_s()
        if self.counter_update_period_s:
            elapsed = math.floor(elapsed / self.counter_update_period_s) * self.counter_update_period_s
        return self._trace.energy(elapsed)

    def power_w(self) -> float:
        return self._trace.power(self.elapsed_s())
