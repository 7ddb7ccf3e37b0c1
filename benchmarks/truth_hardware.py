"""The truth of the end-to-end benchmark and fake hardware that reports from it.

Nothing here shares the meter's model: the truth is an analytic power function of (fake) time, and each
fake sensor reports what a piece of hardware would report from it, with its own schedule and read times.

- :class:`TruthClock`: the one fake clock (s) of a run. ``advance`` moves it without side effects (a sensor
  read that takes time); the benchmark's driver moves it between training hooks and runs the sampler's ticks.
- :class:`PowerTruth`: power (W) as a piecewise-linear function of time, built as the fit runs, and its
  exact integral (J). Segments are only ever appended at or after the latest one.
- :class:`PowerPattern`: what a step, a gap between steps, a validation batch and idle draw (W).
- Sensors implementing the product's ``Sensor`` interface (``lightning_energy.measure.sensors.base``):
  :class:`TruthPowerSensor` (the power at the end of each read, reads taking a drawn time) and
  :class:`TruthCounterSensor` (a cumulative energy counter updating every ``period_s`` on its own phase,
  its value the exact integral up to its latest update; reads taking a drawn time).
- :class:`TruthNvml`: ``tests/fakes_nvml.FakeNvml`` (the H200's documented and measured semantics) whose
  power is a :class:`PowerTruth` instead of levels set by hand, with counter reads of drawn duration.
  Read it through the product's real ``NvmlGpuSensor``.
- :class:`HostMarks` and :class:`LaggingDeviceMarks`: clocks with the product's clock interface
  (``record``/``resolve``/``wait``/``reanchor``, ``lightning_energy.measure.clocks``): marks at the fake time,
  or CUDA-like marks that the "device" reaches ``lag_s`` after they are recorded.
"""

from __future__ import annotations

import bisect
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))

from fakes_nvml import FakeGpu, FakeNvml  # noqa: E402

from lightning_energy.measure.sensors.base import Sensor  # noqa: E402

COUNTER_CALL = "nvmlDeviceGetTotalEnergyConsumption"


class TruthClock:
    """Fake seconds. ``advance`` moves it by hand (what a slow read takes); nothing else happens."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.t = float(start_s)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


class PowerTruth:
    """Power (W) as a piecewise-linear function of time (s), and its exact integral (J).

    Segment ``i`` starts at ``starts[i]`` with power ``watts[i]`` and slope ``slopes[i]`` (W/s) and lasts until
    the next one starts; the last one lasts for ever. ``set`` appends a segment (at or after the latest
    start: the past never changes once a sensor may have read it).
    """

    def __init__(self, start_s: float, watts: float) -> None:
        self.starts = [float(start_s)]
        self.watts = [float(watts)]
        self.slopes = [0.0]
        self.cumulative_J = [0.0]  # energy from the first start to each segment's start

    def set(self, at_s: float, watts: float, slope_W_per_s: float = 0.0) -> None:
        """From ``at_s`` on, the power is ``watts + slope * (t - at_s)``."""
        last = len(self.starts) - 1
        if at_s < self.starts[last]:
            raise ValueError(f"power set at {at_s} s, before the latest segment's start {self.starts[last]} s")
        if at_s == self.starts[last]:
            self.watts[last], self.slopes[last] = float(watts), float(slope_W_per_s)
            return
        self.cumulative_J.append(self.energy_J(at_s))
        self.starts.append(float(at_s))
        self.watts.append(float(watts))
        self.slopes.append(float(slope_W_per_s))

    def _segment(self, t: float) -> int:
        return max(bisect.bisect_right(self.starts, t) - 1, 0)

    def power_W(self, t: float) -> float:
        i = self._segment(t)
        return self.watts[i] + self.slopes[i] * max(t - self.starts[i], 0.0)

    def energy_J(self, t: float) -> float:
        """Energy (J) from the first segment's start to ``t`` (before it: negative, at its power)."""
        i = self._segment(t)
        dt = t - self.starts[i]
        return self.cumulative_J[i] + self.watts[i] * dt + 0.5 * self.slopes[i] * dt * dt

    def energy_between(self, start_s: float, end_s: float) -> float:
        return self.energy_J(end_s) - self.energy_J(start_s)


@dataclass(frozen=True)
class PowerPattern:
    """What the hardware draws (W): in a training step (a linear ramp from ``step_W(...)[0]`` to ``[1]``),
    in validation batches, when idle (before the fit) and between steps: ``gap_W``, or with ``None`` the
    power at the end of the step (or validation batch) before holds until the next one starts (the power then
    changes once per step boundary, at the next step's start)."""

    name: str
    step_W: Callable[[int, random.Random], tuple[float, float]]
    gap_W: float | None = None
    validation_W: float = 110.0
    idle_W: float = 70.0


def alternating(high_W: float = 150.0, low_W: float = 50.0, gap_W: float | None = None) -> PowerPattern:
    """Steps alternate between ``high_W`` and ``low_W``, constant within each step."""
    return PowerPattern(f"alternating {high_W:g}/{low_W:g} W" + (f", {gap_W:g} W gaps" if gap_W is not None else ""),
                        lambda index, rng: (high_W, high_W) if index % 2 == 0 else (low_W, low_W), gap_W=gap_W)


def ramping(start_W: float = 60.0, end_W: float = 240.0) -> PowerPattern:
    """Each step ramps linearly from ``start_W`` to ``end_W`` (a load that builds up within the step)."""
    return PowerPattern(f"ramp {start_W:g}->{end_W:g} W", lambda index, rng: (start_W, end_W))


def random_steps(low_W: float = 40.0, high_W: float = 250.0) -> PowerPattern:
    """Each step draws its own constant power, uniform in ``[low_W, high_W]``."""

    def draw(index: int, rng: random.Random) -> tuple[float, float]:
        watts = rng.uniform(low_W, high_W)
        return watts, watts

    return PowerPattern(f"random {low_W:g}-{high_W:g} W", draw)


def constant(watts: float) -> PowerPattern:
    """The same power in steps, gaps and validation (a host that does not follow the steps)."""
    return PowerPattern(f"constant {watts:g} W", lambda index, rng: (watts, watts), gap_W=watts,
                        validation_W=watts, idle_W=watts)


# ------------------------------------------------------------------------------------------- sensors
class _TimedReads:
    """A read that takes ``read_s`` (s; a ``(low, high)`` range drawn per read) of the fake clock."""

    def __init__(self, clock: TruthClock, read_s: tuple[float, float], rng: random.Random) -> None:
        self.clock = clock
        self.read_s = read_s
        self.rng = rng
        self.reads = 0

    def take_read_time(self) -> float:
        """Spend one read's duration; the time (s) the hardware answers."""
        self.reads += 1
        low, high = self.read_s
        return self.clock.advance(self.rng.uniform(low, high) if high > 0 else 0.0)


class TruthPowerSensor(Sensor):
    """A plain power sensor: each read returns the truth's power (W) at the moment the read answers."""

    def __init__(self, name: str, truth: PowerTruth, clock: TruthClock, read_s: tuple[float, float] = (0.0, 0.0),
                 rng: random.Random | None = None, scope: str = "device") -> None:
        super().__init__(name, scope, source=f"truth power sensor (reads {read_s[0] * 1e3:g}-{read_s[1] * 1e3:g} ms)")
        self.truth = truth
        self._reads = _TimedReads(clock, read_s, rng or random.Random(0))
        self.max_read_s = read_s[1]

    def power_w(self) -> float:
        return self.truth.power_W(self._reads.take_read_time())


class TruthCounterSensor(Sensor):
    """A plain energy counter (J) that updates every ``period_s`` at ``phase_s + k * period_s``; its value is
    the truth's exact energy up to its latest update. Reads take a drawn time."""

    def __init__(self, name: str, truth: PowerTruth, clock: TruthClock, phase_s: float, period_s: float = 0.1,
                 read_s: tuple[float, float] = (0.0, 0.0), rng: random.Random | None = None,
                 scope: str = "device") -> None:
        super().__init__(name, scope, source=f"truth energy counter ({period_s * 1e3:g} ms updates)")
        self.truth = truth
        self.phase_s = phase_s
        self.period_s = period_s
        self.counter_update_period_s = period_s
        self._reads = _TimedReads(clock, read_s, rng or random.Random(0))
        self.max_read_s = read_s[1]

    def latest_update_s(self, t: float) -> float:
        return self.phase_s + math.floor((t - self.phase_s) / self.period_s + 1e-9) * self.period_s

    def energy_j(self) -> float:
        answered = self._reads.take_read_time()
        return self.truth.energy_between(self.truth.starts[0], self.latest_update_s(answered))


class TruthNvml(FakeNvml):
    """``FakeNvml`` whose GPU ``i`` draws ``truths[i]``: the counter, the instant field (mean of the observed
    window ending ``instant_lag_s`` before each refresh, ``instant_phase_s`` after the counter's updates) and the
    1-s average all derive from it. Each counter read takes a duration drawn from ``counter_read_s``."""

    def __init__(self, gpus: list[FakeGpu], clock: TruthClock, truths: list[PowerTruth],
                 counter_read_s: tuple[float, float] = (0.0, 0.0), rng: random.Random | None = None) -> None:
        self.truths = truths
        self.counter_read_s = counter_read_s
        self._rng = rng or random.Random(0)
        for gpu, truth in zip(gpus, truths):
            gpu.power_W = truth.power_W(clock())  # what the instant field holds before its first full window
        super().__init__(gpus, clock, sleep=clock.advance)

    @property
    def max_read_s(self) -> float:
        return self.counter_read_s[1]

    def energy_mJ(self, index: int, at_s: float) -> float:
        return self.truths[index].energy_between(self.loaded_at_s, at_s) * 1000.0

    def _enter(self, name: str, needs_init: bool = True) -> None:
        if name == COUNTER_CALL:
            low, high = self.counter_read_s
            self.latency_s[name] = self._rng.uniform(low, high) if high > 0 else 0.0
        super()._enter(name, needs_init)


# ------------------------------------------------------------------------------------------- mark clocks
class HostMarks:
    """Product clock interface: a mark is the fake time of the call (as ``HostClock`` on real time)."""

    asynchronous = False

    def __init__(self, clock: TruthClock) -> None:
        self.clock = clock

    def record(self) -> float:
        return self.clock()

    def resolve(self, token: float) -> float:
        return token

    def wait(self, token: float) -> float:
        return token

    def reanchor(self) -> None:
        """Nothing to re-anchor on the host."""


class DeviceToken:
    """A CUDA-like mark: the fake time its device reaches it."""

    __slots__ = ("reached_s",)

    def __init__(self, reached_s: float) -> None:
        self.reached_s = reached_s


class LaggingDeviceMarks:
    """Product clock interface of an asynchronous device (``asynchronous = True``, as ``CudaEventClock``): the
    device runs ``lag_s`` behind the host, so a mark recorded at host time ``h`` is reached at ``h + lag_s``;
    ``resolve`` answers only once the fake clock has passed it; ``wait`` blocks until the device reaches it
    (``block_until(t)``: the benchmark's driver lets the sampling thread run meanwhile)."""

    asynchronous = True

    def __init__(self, clock: TruthClock, lag_s: float, block_until: Callable[[float], None]) -> None:
        self.clock = clock
        self.lag_s = lag_s
        self.block_until = block_until
        self.waits = 0

    def record(self) -> DeviceToken:
        return DeviceToken(self.clock() + self.lag_s)

    def resolve(self, token: DeviceToken) -> float | None:
        return token.reached_s if self.clock() >= token.reached_s else None

    def wait(self, token: DeviceToken) -> float:
        self.waits += 1
        if self.clock() < token.reached_s:
            self.block_until(token.reached_s)
        return token.reached_s

    def reanchor(self) -> None:
        """The fake device needs no anchor: its marks resolve exactly."""
