"""A simulated NVIDIA-like GPU: power-limit range and default, step time and power vs limit, energy counter.

Why a subclass of Zeus's ``zeus.device.gpu.common.GPU``: the power-limit code of this package drives a
GPU only through that abstract class (``get_power_management_limit_constraints``,
``set_power_management_limit``, ``get_persistence_mode`` ..., milliwatts and millijoules as in NVML).
The real path gets Zeus's ``NVIDIAGPU`` (or ``ZeusdNVIDIAGPU``) through
:mod:`lightning_energy.optimize.power_limit.gpu_control`; the simulated path gets a :class:`SimulatedGPU`, so the optimiser
runs unmodified against either. Being a real ``GPU`` subclass also lets Zeus's own code drive it: the
tests (``tests/zeus_gpus.py``) make ``zeus.device.get_gpus()`` return simulated GPUs and run Zeus's
``GlobalPowerLimitOptimizer`` against the same simulator to check that our callback follows its state
machine step for step.

The model: what published measurements show, in the fewest parameters that show it.

- A step at full clocks takes ``t_full(b) = overhead_s + per_sample_s*b + contention_s*b**2`` of GPU
  work for a batch of ``b`` samples and draws ``demand_W(b)`` (utilisation saturates with the batch);
  ``host_s`` more per step is host-bound (data loading, CPU work) and the card idles at ``idle_W`` then:
  a cap changes nothing while the host is the bottleneck, and the card does not draw the cap meanwhile.
- Busy power at SM clock fraction ``x`` (1 = maximum clock): ``static_W + (demand - static_W) * x * v(x)**2``
  with ``v(x) = max(x, voltage_floor)``: dynamic power goes with f*V^2; DVFS lowers the voltage with the
  clock down to a floor, below which only the clock falls (power then linear in f). Under a cap the
  card runs the highest clock whose draw fits (NVIDIA's power capping is DVFS: the driver lowers clocks,
  "SW Power Cap" in ``nvidia-smi -q -d PERFORMANCE``), from ``clock_bins`` discrete clocks when given
  (plateaus: neighbouring limits that fit the same clock bin cost the same). Above the voltage floor
  energy per unit of work falls as the clock falls (f^2), diminishing returns of time near TDP; below
  it the static draw over a longer step dominates and energy rises again: the energy optimum is
  interior wherever the limit range reaches below the voltage floor (or ``static_W`` is a large share).
- ``clock_floor``: the lowest clock the cap can ask for; a limit below the draw there cannot be met by
  DVFS and the card throttles hard to ``throttle_clock`` (a cliff: step time jumps).
- Only the compute-bound share of the GPU work slows down: ``t = t_full * (compute_fraction / x + 1 -
  compute_fraction)`` (memory-bound steps barely change; steps that never reach the limit not at all).

What the model is calibrated to, and the published sources for each shape:

- The V100 power-limit study of this project (CONTEXT: limits 150-300 W, energy, time and EDP close to
  quadratic, the lowest limit the least energy at some cost in time): the default card is a V100 whose
  150-300 W range stays above the voltage floor.
- Zeus (J. You, J.-W. Chung, M. Chowdhury, "Zeus: Understanding and Optimizing GPU Energy Consumption
  of DNN Training", NSDI 2023): across DNN training jobs the energy-optimal power limit differs per job
  and is often below the maximum, and time rises as the limit falls (an energy-time trade-off).
- "Performance and Energy Aware Training of a Deep Neural Network in a Multi-GPU Environment with Power
  Capping" (Euro-Par 2023 Workshops, doi:10.1007/978-3-031-48803-0_1; Gdansk University of Technology):
  on an 8-GPU workstation, non-default caps of 160-200 W (default 260 W) saved over 25 % energy and
  improved EDP by over 17 %: the best cap lies inside the range, not at its end.
- P. Patel, Z. Gong, S. Rizvi, E. Choukse, P. Misra, T. Anderson, A. Sriraman, "Towards Improved Power
  Management in Cloud GPUs" (IEEE Computer Architecture Letters 22, 2023, doi:10.1109/LCA.2023.3278652):
  power capping and DVFS on current server GPUs are coarse and non-intuitive in their effect (which is
  why the model has clock bins and a hard-throttle cliff rather than a smooth curve).
- Z. Tang, Y. Wang, Q. Wang, X. Chu, "The Impact of GPU DVFS on the Energy and Performance of Deep
  Learning: an Empirical Study" (e-Energy 2019): compared with the default core clock, the
  energy-optimal core clock (inside the range) saved energy in most DNN training cases studied.

Time runs on a clock: real time (a step sleeps for its duration), an injected fake clock with an
``advance(seconds)`` method (tests: a step advances it, runs take no time and energies are exact), or
``clock="simulated"``: the card keeps its own time, which moves only by the modelled step (and host)
time, so its energy counter and :meth:`SimulatedGPU.simulated_reading` do not depend on the host (a demo
that picks the same limit every run); the step still sleeps its modelled time unless ``sleep=False``.
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

with contextlib.redirect_stdout(io.StringIO()):  # zeus pulls amdsmi, which prints without ROCm
    from zeus.device.gpu.common import (
        GPU,
        ZeusGPUInvalidArgError,
        ZeusGPUNoPermissionError,
        ZeusGPUNotSupportedError,
    )

from lightning.pytorch import Callback
from typing_extensions import override

from lightning_energy.integration.lightning_internals import first_batch_size
from lightning_energy.provenance import SIMULATED
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.units import BYTES_PER_GIB, MJ_PER_J, MW_PER_W


# The V100 study: limits 150/200/250/300 W; 150 W is the V100's NVML minimum, 300 W its SXM2 default.
V100_MIN_LIMIT_W = 150
V100_MAX_LIMIT_W = 300
V100_DEFAULT_LIMIT_W = 300
V100_IDLE_W = 40.0  # an idle V100 SXM2 in persistence mode
V100_STATIC_W = 60.0  # draw at the lowest clock under load (leakage, memory, fans)
V100_MEMORY_B = 16 * BYTES_PER_GIB
V100_NAME = "Simulated Tesla V100-SXM2-16GB"
# DVFS lowers the voltage with the clock down to about 60 % of the maximum clock (then only the clock falls);
# on the V100's 150-300 W range the clock stays above it, as the V100 study's quadratic curves need.
DEFAULT_VOLTAGE_FLOOR = 0.6
DEFAULT_THROTTLE_CLOCK = 0.3  # a hard throttle when no DVFS clock meets the cap (a cliff in step time)


@dataclass(frozen=True)
class StepModel:
    """What one training step asks of the GPU at full clocks (seconds, watts, bytes).

    Args:
        overhead_s: fixed time per step (kernel launches, optimizer step).
        per_sample_s: time per sample.
        contention_s: time per sample squared (caches thrash as the batch grows).
        demand_W: draw at full clocks once the batch saturates the card (above the max limit:
            compute-heavy, the V100 study's case; below the min limit: a small net that gains nothing).
        half_utilisation_batch: batch size at which the draw is half-way from static to ``demand_W``.
        compute_fraction: share of the step time that scales with the SM clock (0: memory-bound).
        reference_batch: the batch size of a step when the caller gives none.
        base_memory_B, per_sample_memory_B: memory of the model and per sample (OOM past the card's).
        host_s: host-bound time per step (data loading, CPU work) while the card idles.
    """

    overhead_s: float = 0.002
    per_sample_s: float = 5e-5
    contention_s: float = 1e-7
    demand_W: float = 420.0
    half_utilisation_batch: float = 64.0
    compute_fraction: float = 0.9
    reference_batch: int = 256
    base_memory_B: int = 2 * BYTES_PER_GIB
    per_sample_memory_B: int = 48 * 1024**2
    host_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overhead_s", "per_sample_s", "contention_s", "half_utilisation_batch", "host_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}")
        if not self.demand_W > 0:
            raise ValueError(f"`demand_W` must be > 0 W, got {self.demand_W!r}")
        if not 0.0 <= self.compute_fraction <= 1.0:
            raise ValueError(f"`compute_fraction` must be in [0, 1], got {self.compute_fraction!r}")
        if not (isinstance(self.reference_batch, int) and self.reference_batch >= 1):
            raise ValueError(f"`reference_batch` must be an integer >= 1, got {self.reference_batch!r}")

    def full_clock_time_s(self, batch_size: int) -> float:
        return self.overhead_s + self.per_sample_s * batch_size + self.contention_s * batch_size**2

    def demand_at_W(self, batch_size: int, static_W: float) -> float:
        """Draw of a step of ``batch_size`` samples at full clocks."""
        share = batch_size / (batch_size + self.half_utilisation_batch) if batch_size > 0 else 0.0
        return static_W + (self.demand_W - static_W) * share if self.demand_W > static_W else self.demand_W

    def memory_B(self, batch_size: int) -> int:
        return int(self.base_memory_B + self.per_sample_memory_B * batch_size)


# A compute-heavy net as in the V100 study, and a memory-bound one whose time barely moves with the limit.
COMPUTE_BOUND = StepModel()
MEMORY_BOUND = StepModel(compute_fraction=0.2)
SMALL_NET = StepModel(demand_W=120.0)  # draws ~110 W, under the 150 W minimum limit: no limit changes anything

_REGISTRY: dict[int, "SimulatedGPU"] = {}
_REGISTRY_LOCK = threading.Lock()


def simulated_gpu(gpu_index: int) -> "SimulatedGPU":
    """The simulated GPU most recently created with ``gpu_index`` in this process."""
    with _REGISTRY_LOCK:
        gpu = _REGISTRY.get(gpu_index)
    if gpu is None:
        raise LookupError(f"no SimulatedGPU with gpu_index={gpu_index} exists in this process; create one first")
    return gpu


class SimulatedClock:
    """The card's own time (s): moves only by what the model says a step (and its host part) takes."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


class SimulatedGPU(GPU):
    """An NVIDIA-like GPU whose step time and power follow its power limit (see the module docstring).

    Args:
        gpu_index: index of the card (``simulated_gpu(index)`` finds it; one per index per process).
        name: the model name NVML would report.
        min_limit_W, max_limit_W, default_limit_W: power-limit constraints and default (W).
        step: the workload's :class:`StepModel`.
        idle_W: draw while no step runs (before the workload, between steps, host-bound time) (W).
        static_W: draw at the lowest clock under load (W).
        memory_B: memory of the card (bytes); a step that needs more raises ``torch.OutOfMemoryError``.
        can_set_limits: ``False`` simulates a process without SYS_ADMIN and without the Zeus daemon.
        clock: ``None`` for real time (steps sleep), a fake clock (callable in seconds with an
            ``advance(seconds)`` method; steps advance it), or ``"simulated"``: the card's own
            :class:`SimulatedClock` (energy and :meth:`simulated_reading` independent of the host).
        sleep: with ``clock="simulated"``, whether a step also sleeps its modelled time (a paced demo).
        voltage_floor: clock fraction below which the voltage stops falling (dynamic power ~ f there).
        clock_floor: lowest clock fraction the cap can ask for; below its draw the card throttles hard.
        throttle_clock: the clock fraction of that hard throttle (a cliff in step time).
        clock_bins: number of discrete clocks (``k / clock_bins`` of the maximum); 0: continuous.
        persistence_mode: the persistence mode the card starts in (as an administrator left it).
    """

    def __init__(
        self,
        gpu_index: int = 0,
        name: str = V100_NAME,
        min_limit_W: int = V100_MIN_LIMIT_W,
        max_limit_W: int = V100_MAX_LIMIT_W,
        default_limit_W: int = V100_DEFAULT_LIMIT_W,
        step: StepModel = COMPUTE_BOUND,
        idle_W: float = V100_IDLE_W,
        static_W: float = V100_STATIC_W,
        memory_B: int = V100_MEMORY_B,
        can_set_limits: bool = True,
        clock: Any = None,
        sleep: bool = True,
        voltage_floor: float = DEFAULT_VOLTAGE_FLOOR,
        clock_floor: float = 0.0,
        throttle_clock: float = DEFAULT_THROTTLE_CLOCK,
        clock_bins: int = 0,
        persistence_mode: bool = False,
    ) -> None:
        super().__init__(gpu_index)
        for arg, value in (("min_limit_W", min_limit_W), ("max_limit_W", max_limit_W),
                           ("default_limit_W", default_limit_W)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{arg}` must be a positive integer (W), got {value!r}")
        if not min_limit_W <= default_limit_W <= max_limit_W:
            raise ValueError(f"need min_limit_W <= default_limit_W <= max_limit_W, got {min_limit_W}, "
                             f"{default_limit_W}, {max_limit_W}")
        if not (idle_W >= 0 and 0 <= static_W < min_limit_W):
            raise ValueError(f"need idle_W >= 0 and 0 <= static_W < min_limit_W, got {idle_W}, {static_W}")
        if not isinstance(step, StepModel):
            raise TypeError(f"`step` must be a StepModel, got {type(step).__name__}")
        if clock == "simulated":
            clock = SimulatedClock()
        elif clock is not None and not (callable(clock) and hasattr(clock, "advance")):
            raise TypeError("`clock` must be None (real time), 'simulated' or a callable with an advance(seconds) "
                            "method")
        for arg, value in (("voltage_floor", voltage_floor), ("clock_floor", clock_floor),
                           ("throttle_clock", throttle_clock)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"`{arg}` must be a clock fraction in [0, 1], got {value!r}")
        if not throttle_clock > 0:
            raise ValueError(f"`throttle_clock` must be > 0, got {throttle_clock!r}")
        if isinstance(clock_bins, bool) or not isinstance(clock_bins, int) or clock_bins < 0:
            raise ValueError(f"`clock_bins` must be an integer >= 0, got {clock_bins!r}")
        self.name = name
        self.min_limit_W, self.max_limit_W, self.default_limit_W = min_limit_W, max_limit_W, default_limit_W
        self.step = step
        self.idle_W, self.static_W = float(idle_W), float(static_W)
        self.memory_B = int(memory_B)
        self.can_set_limits = can_set_limits
        self.voltage_floor, self.clock_floor = float(voltage_floor), float(clock_floor)
        self.throttle_clock, self.clock_bins = float(throttle_clock), clock_bins
        self.own_clock = isinstance(clock, SimulatedClock)
        self._sleep = sleep
        self._fake_clock = clock
        self._now: Callable[[], float] = clock if clock is not None else time.perf_counter
        self._lock = threading.Lock()
        self._limit_W = default_limit_W
        self._persistence = bool(persistence_mode)
        self._running_batch: int | None = None  # batch size of the workload on the card (None: idle)
        self._energy_J = 0.0
        self._t_last = self._now()
        self._power_W = self.idle_W
        self.peak_memory_B = 0
        self.limit_log: list[int] = []  # every limit (W) set, in order, defaults included
        self.limit_events: list[tuple[int, int]] = []  # (steps run before it, limit W) for every limit set
        self.persistence_log: list[bool] = []  # every persistence mode set, in order
        self.steps_run = 0
        with _REGISTRY_LOCK:
            _REGISTRY[gpu_index] = self

    # ------------------------------------------------------------------ the model
    def _demand_W(self, batch_size: int) -> float:
        return self.step.demand_at_W(batch_size, self.static_W)

    def busy_power_W(self, clock: float, batch_size: int | None = None) -> float:
        """Draw (W) of a step of ``batch_size`` at SM clock fraction ``clock`` (see the module docstring)."""
        demand = self._demand_W(self.step.reference_batch if batch_size is None else batch_size)
        if demand <= self.static_W:
            return demand
        volts = max(clock, self.voltage_floor)
        return self.static_W + (demand - self.static_W) * clock * volts * volts

    def clock_fraction(self, limit_W: float | None = None, batch_size: int | None = None) -> float:
        """SM clock as a fraction of the maximum under ``limit_W`` for a step of ``batch_size``: the highest
        (binned) clock whose draw fits the limit; the hard throttle clock where none at or above
        ``clock_floor`` fits."""
        limit = self._limit_W if limit_W is None else limit_W
        demand = self._demand_W(self.step.reference_batch if batch_size is None else batch_size)
        if limit >= demand:
            return 1.0
        dynamic = demand - self.static_W
        head = max(limit - self.static_W, 0.0) / dynamic
        knee = self.voltage_floor
        clock = head ** (1.0 / 3.0) if head >= knee**3 else (head / (knee * knee) if knee > 0 else 0.0)
        if self.clock_bins:
            clock = math.floor(clock * self.clock_bins + 1e-9) / self.clock_bins
        if clock <= 0.0 or clock < self.clock_floor:
            return self.throttle_clock
        return min(clock, 1.0)

    def step_gpu_time_s(self, limit_W: float | None = None, batch_size: int | None = None) -> float:
        """Seconds the card is busy in one step under ``limit_W`` (default: the current limit)."""
        b = self.step.reference_batch if batch_size is None else batch_size
        c = self.step.compute_fraction
        return self.step.full_clock_time_s(b) * (c / self.clock_fraction(limit_W, b) + 1.0 - c)

    def step_time_s(self, limit_W: float | None = None, batch_size: int | None = None) -> float:
        """Duration (s) of one step under ``limit_W`` (default: the current limit), host-bound part included."""
        return self.step_gpu_time_s(limit_W, batch_size) + self.step.host_s

    def step_power_W(self, limit_W: float | None = None, batch_size: int | None = None) -> float:
        """Draw (W) while the card works on a step of ``batch_size`` under ``limit_W``."""
        b = self.step.reference_batch if batch_size is None else batch_size
        return self.busy_power_W(self.clock_fraction(limit_W, b), b)

    def step_energy_J(self, limit_W: float | None = None, batch_size: int | None = None) -> float:
        """Energy (J) of one step: the busy part at the step's draw, the host-bound part at ``idle_W``."""
        busy = self.step_power_W(limit_W, batch_size) * self.step_gpu_time_s(limit_W, batch_size)
        return busy + self.idle_W * self.step.host_s

    # ------------------------------------------------------------------ the workload
    def run_step(self, batch_size: int | None = None) -> float:
        """Run one step of ``batch_size`` samples: sleep or advance the clock; returns its seconds.

        The card draws the step's power while busy and ``idle_W`` for the host-bound part and after the
        step (until the next one): host work between steps is not billed at the cap.
        """
        import torch

        b = self.step.reference_batch if batch_size is None else int(batch_size)
        need = self.step.memory_B(b)
        if need > self.memory_B:
            raise torch.OutOfMemoryError(
                f"simulated GPU {self.gpu_index}: a batch of {b} needs {need / BYTES_PER_GIB:.1f} GiB of {self.memory_B / BYTES_PER_GIB:.1f} GiB"
            )
        with self._lock:
            self._account()
            self._running_batch = b
            self._power_W = self.step_power_W(batch_size=b)
            busy_s = self.step_gpu_time_s(batch_size=b)
            self.peak_memory_B = max(self.peak_memory_B, need)
        self._pass(busy_s)
        with self._lock:
            self._account()
            self._power_W = self.idle_W
        self._pass(self.step.host_s)
        with self._lock:
            self._account()
        self.steps_run += 1
        return busy_s + self.step.host_s

    def _pass(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._fake_clock is not None:
            self._fake_clock.advance(seconds)
            if self.own_clock and self._sleep:
                time.sleep(seconds)
        else:
            time.sleep(seconds)

    def stop_workload(self) -> None:
        """The workload has finished: the card idles."""
        with self._lock:
            self._account()
            self._running_batch = None
            self._power_W = self.idle_W

    def reset_peak_memory(self) -> None:
        self.peak_memory_B = 0

    def _account(self) -> None:
        """Add the energy since the last change at the power drawn since (caller holds the lock)."""
        now = self._now()
        self._energy_J += self._power_W * max(now - self._t_last, 0.0)
        self._t_last = now

    def energy_J(self) -> float:
        """Cumulative energy (J) since the GPU object was created."""
        with self._lock:
            self._account()
            return self._energy_J

    def simulated_reading(self) -> tuple[float, float] | None:
        """(energy J, time s) on the card's own clock (``clock="simulated"``), else None: what a profiling
        window of a simulated card is measured with, independent of the host's timing."""
        if not self.own_clock:
            return None
        with self._lock:
            self._account()
            return self._energy_J, self._now()

    @property
    def power_limit_W(self) -> int:
        return self._limit_W

    def energy_sensor(self, name: str | None = None) -> "SimulatedGpuSensor":
        """The sensor that reads this card's energy counter (what NVML's counter is for a real one)."""
        return SimulatedGpuSensor(gpu=self, name=name)

    # ------------------------------------------------------------------ zeus.device.gpu.common.GPU
    @property
    def supports_nonblocking_setters(self) -> bool:
        return False

    def get_name(self) -> str:
        return self.name

    def get_power_management_limit_constraints(self) -> tuple[int, int]:
        return (self.min_limit_W * MW_PER_W, self.max_limit_W * MW_PER_W)

    def get_power_management_limit(self) -> int:
        return self._limit_W * MW_PER_W

    def get_default_power_management_limit(self) -> int:
        """Default limit (mW), NVML's ``nvmlDeviceGetPowerManagementDefaultLimit``."""
        return self.default_limit_W * MW_PER_W

    def _require_permission(self, what: str) -> None:
        if not self.can_set_limits:
            raise ZeusGPUNoPermissionError(f"simulated GPU {self.gpu_index}: no permission to {what} "
                                           "(created with can_set_limits=False)")

    def set_power_management_limit(self, power_limit_mw: int, block: bool = True) -> None:
        self._require_permission("set the power limit")
        low, high = self.get_power_management_limit_constraints()
        if not low <= power_limit_mw <= high:
            raise ZeusGPUInvalidArgError(f"power limit {power_limit_mw} mW outside [{low}, {high}] mW")
        with self._lock:
            self._account()
            self._limit_W = int(round(power_limit_mw / MW_PER_W))
            if self._running_batch is not None:
                self._power_W = self.step_power_W(batch_size=self._running_batch)
            self.limit_log.append(self._limit_W)
            self.limit_events.append((self.steps_run, self._limit_W))

    def reset_power_management_limit(self, block: bool = True) -> None:
        self.set_power_management_limit(self.default_limit_W * MW_PER_W, block)

    def set_persistence_mode(self, enabled: bool, block: bool = True) -> None:
        self._require_permission("set persistence mode")
        self._persistence = bool(enabled)
        self.persistence_log.append(bool(enabled))

    def get_persistence_mode(self) -> bool:
        return self._persistence

    def get_supported_memory_clocks(self) -> list[int]:
        return [877]  # V100 HBM2

    def set_memory_locked_clocks(self, min_clock_mhz: int, max_clock_mhz: int, block: bool = True) -> None:
        raise ZeusGPUNotSupportedError("the simulated GPU models power limits, not locked clocks")

    def reset_memory_locked_clocks(self, block: bool = True) -> None:
        """Nothing is locked on the simulated GPU."""

    def get_supported_graphics_clocks(self, memory_clock_mhz: int | None = None) -> list[int]:
        return [1530]

    def set_gpu_locked_clocks(self, min_clock_mhz: int, max_clock_mhz: int, block: bool = True) -> None:
        raise ZeusGPUNotSupportedError("the simulated GPU models power limits, not locked clocks")

    def reset_gpu_locked_clocks(self, block: bool = True) -> None:
        """Nothing is locked on the simulated GPU."""

    def get_average_power_usage(self) -> int:
        return self.get_instant_power_usage()

    def get_instant_power_usage(self) -> int:
        with self._lock:
            return int(round(self._power_W * MW_PER_W))

    def get_average_memory_power_usage(self) -> int:
        raise ZeusGPUNotSupportedError("the simulated GPU has no separate memory power reading")

    def supports_get_total_energy_consumption(self) -> bool:
        return True

    def get_total_energy_consumption(self) -> int:
        return int(self.energy_J() * MJ_PER_J)

    def get_gpu_temperature(self) -> int:
        with self._lock:
            return int(30 + 0.15 * self._power_W)


class SimulatedGpuSensor(Sensor):
    """The energy counter of a :class:`SimulatedGPU` (scope ``"device"``), exact at every reading.

    Give the GPU object, or its ``gpu_index`` (looked up when the sensor opens, so a LightningCLI config
    can name the same card in two places).
    """

    provenance = SIMULATED  # a modelled card's counter: its joules are simulated, not measured

    def __init__(self, gpu_index: int = 0, gpu: SimulatedGPU | None = None, name: str | None = None) -> None:
        index = gpu.gpu_index if gpu is not None else gpu_index
        super().__init__(name or f"simgpu{index}", "device", source=f"simulated GPU {index} energy counter")
        self.gpu_index = index
        self._gpu = gpu

    @property
    def gpu(self) -> SimulatedGPU:
        if self._gpu is None:
            self._gpu = simulated_gpu(self.gpu_index)
        return self._gpu

    def identity(self) -> tuple:
        return (*super().identity(), self.gpu_index)

    def open(self) -> None:
        self.source = f"simulated GPU {self.gpu_index} ({self.gpu.name}) energy counter"

    def energy_j(self) -> float:
        return self.gpu.energy_J()

    def read_fields(self) -> dict[str, float]:
        gpu = self.gpu
        return {"power_W": gpu.get_instant_power_usage() / MW_PER_W, "power_limit_W": float(gpu.power_limit_W)}


class SimulatedWorkload(Callback):
    """Runs each training batch on a simulated GPU: the step takes the time and power the model says.

    Add it beside the LightningModule when the GPU is simulated; the batch's sample count (first
    dimension of its first tensor) is the step's batch size. Batch-size trials keep it (it stands for the
    hardware), see ``keep_during_trials``.

    Args:
        gpu_index: the :class:`SimulatedGPU` to run on (looked up at setup), or give ``gpu``.
        gpu: the simulated GPU itself.
        batch_size: simulate steps of this many samples whatever the real batches hold (a toy model
            standing in for a big one); ``None``: the samples in each batch.
    """

    keep_during_trials = True

    def __init__(self, gpu_index: int = 0, gpu: SimulatedGPU | None = None, batch_size: int | None = None) -> None:
        super().__init__()
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"`batch_size` must be an integer >= 1 or None, got {batch_size!r}")
        self.gpu_index = gpu.gpu_index if gpu is not None else gpu_index
        self.gpu = gpu
        self.batch_size = batch_size

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.gpu is None:
            self.gpu = simulated_gpu(self.gpu_index)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.gpu.run_step(self.batch_size if self.batch_size is not None else first_batch_size(batch))

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        self.gpu.stop_workload()
