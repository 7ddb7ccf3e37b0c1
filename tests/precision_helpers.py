"""Helpers for the precision tests and the DDP script: simulated per-mode cost models and fault injection.

Two cost models: :class:`SimulatedModeCosts` on fake time (``power_limit_helpers.install_fake_time``): each
step's mode sets its fake duration and its power on an exact energy counter, so profiles, picks and
energies are deterministic; :class:`ModePowerSensor` + :class:`FollowMode` in real time (steps sleep), for
the DDP script and configs, where only choices far beyond any jitter may be asserted.
"""

from __future__ import annotations

import random
import time

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from conftest import TinyRegressor
from lightning_energy.measure.sampler import get_sampler
from lightning_energy.measure.sensors.base import Sensor

SAMPLER_INTERVAL_S = 0.002
STEP_SLEEP_S = 0.01  # each training step sleeps this long, so steps take about the same time in every mode
PAUSE_S = 0.1  # >> the sampler interval: a simulated power change lies well away from any window edge


class ModePowerSensor(Sensor):
    """Power that depends on the precision mode in use: a simulated cost model (W per mode)."""

    def __init__(self, watts_by_mode: dict[str, float], name: str = "device") -> None:
        super().__init__(name, scope="device", source="simulated per-mode power")
        self.watts_by_mode = dict(watts_by_mode)
        self.mode = "32-true"

    def power_w(self) -> float:
        return self.watts_by_mode[self.mode]

    def identity(self) -> tuple:
        return (*super().identity(), tuple(sorted(self.watts_by_mode.items())))


class FollowMode(L.Callback):
    """Moves the sensor to the plugin's mode at the end of a training step, ``pause_s`` away from the step.

    Put it after ``PrecisionSwitch`` in the callback list: when the mode has changed it sleeps ``pause_s``,
    changes the simulated power and sleeps ``pause_s`` again, so the change lies far (in sampler intervals)
    from the end mark of the last step of the old mode and from the start mark of the first step of the new
    one, and takes a sample just before and just after it, so the change is bracketed by samples even when
    the sampling thread is starved. Each measured window then sees constant power and the expected
    energies are exact. With no
    ``sensor`` (a callback built from a config) it follows the ModePowerSensor given to the PrecisionSwitch.
    """

    def __init__(self, sensor: ModePowerSensor | None = None, pause_s: float = PAUSE_S) -> None:
        self.sensor = sensor
        self.pause_s = pause_s

    def setup(self, trainer, pl_module, stage) -> None:
        if self.sensor is None:
            from lightning_energy.callbacks.precision import PrecisionSwitch

            self.sensor = next(s for c in trainer.callbacks if isinstance(c, PrecisionSwitch)
                               for s in c._user_sensors or () if isinstance(s, ModePowerSensor))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mode = trainer.precision_plugin.mode_name
        if mode != self.sensor.mode:
            time.sleep(self.pause_s)
            sampler = get_sampler()
            sampler.sample_once()
            self.sensor.mode = mode
            sampler.sample_once()
            time.sleep(self.pause_s)


class FaultyRegressor(TinyRegressor):
    """TinyRegressor whose steps sleep ``STEP_SLEEP_S`` and can misbehave from a given step on.

    ``fault`` applies only while autocast is on (reduced precision), never in the float32 replay of the
    probe (with ``any_mode``: in every mode, float32 included), from global step ``fault_step`` (for
    ``fault_steps`` steps, None: for ever):
    ``"nan"`` / ``"inf"`` make the loss NaN / infinite, ``"drift"`` multiplies it by 1.1 (a 10 % loss gap), ``"offset"`` adds 100
    (an exploding loss with unchanged gradients). ``ranks``: the ranks that misbehave (None: all).
    ``clean_every``, ``clean_phase``: steps with ``global_step % clean_every == clean_phase`` do not misbehave
    (an unrepresentative batch now and then).
    """

    def __init__(self, fault: str | None = None, fault_step: int = 0, fault_steps: int | None = None,
                 ranks: tuple[int, ...] | None = None, sleep_s: float = STEP_SLEEP_S, any_mode: bool = False,
                 clean_every: int | None = None, clean_phase: int = 0) -> None:
        super().__init__()
        self.clean_every, self.clean_phase = clean_every, clean_phase
        self.fault, self.fault_step, self.fault_steps, self.ranks = fault, fault_step, fault_steps, ranks
        self.any_mode = any_mode
        self.sleep_s = sleep_s
        self.losses: list[float] = []
        self.param_dtypes: set[torch.dtype] = set()

    def _faulty(self) -> bool:
        if self.fault is None or not (self.any_mode or torch.is_autocast_enabled(self.device.type)):
            return False
        if self.ranks is not None and self.global_rank not in self.ranks:
            return False
        step = self.global_step
        if self.clean_every is not None and step % self.clean_every == self.clean_phase:
            return False
        return step >= self.fault_step and (self.fault_steps is None or step < self.fault_step + self.fault_steps)

    def training_step(self, batch, batch_idx):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self._faulty():
            if self.fault in ("nan", "inf"):
                loss = loss * torch.tensor(float(self.fault))
            elif self.fault == "drift":
                loss = loss * 1.1
            elif self.fault == "offset":
                loss = loss + 100.0
            else:
                raise ValueError(f"unknown fault {self.fault!r}")
        self.log("train/loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.param_dtypes.update(p.dtype for p in self.parameters())


class SleepyBoringModel(BoringModel):
    """Lightning's BoringModel whose training steps sleep ``STEP_SLEEP_S``: each step takes at least that long."""

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_SLEEP_S)
        return super().training_step(batch, batch_idx)


class ClockedEnergyCounter(Sensor):
    """A device energy counter (J) on a fake clock: the simulation sets its power, it integrates exactly.

    ``clock`` is a callable in seconds with ``advance(seconds)`` (``power_limit_helpers.SamplingClock``). The
    counter is the exact integral of the power set so far up to the clock's time, so every window the
    meter takes between two marks on that clock is exact, whatever the sampling.
    """

    def __init__(self, clock, name: str = "device", estimated: bool = False) -> None:
        super().__init__(name, scope="device", source="simulated energy counter on a fake clock")
        self.clock = clock
        self.estimated = estimated
        self.power_W = 0.0
        self._energy_J = 0.0
        self._t_s = clock()

    def _account(self) -> None:
        now = self.clock()
        self._energy_J += self.power_W * (now - self._t_s)
        self._t_s = now

    def run(self, watts: float, seconds: float) -> None:
        """Draw ``watts`` for ``seconds`` of fake time (the clock advances)."""
        self._account()
        self.power_W = float(watts)
        self.clock.advance(seconds)
        self._account()

    def energy_j(self) -> float:
        self._account()
        return self._energy_J

    def identity(self) -> tuple:
        return (*super().identity(), id(self))


class SimulatedModeCosts(L.Callback):
    """Simulated hardware on a fake clock: a step in mode ``m`` draws ``watts_by_mode[m]`` for ``step_s`` fake seconds.

    ``step_s``: ``step_s_by_mode[m]`` (default STEP_SLEEP_S for every mode) times ``1 + noise * z`` with ``z``
    drawn from a seeded normal per batch (bounded to [-3, 3]): deterministic run-to-run noise; times
    ``1 + drift_per_step * n`` at the n-th batch (a machine whose load drifts). The energy goes
    to :attr:`counter` (give it to ``PrecisionSwitch(sensors=[...])``). Put it after the ``PrecisionSwitch``
    in the callback list: it runs the step in ``on_train_batch_start``, after the timeline's start mark and
    the probe's replay (which takes no fake time), in the mode the step runs in.
    """

    def __init__(self, clock, watts_by_mode: dict[str, float], step_s_by_mode: dict[str, float] | None = None,
                 noise: float = 0.0, seed: int = 0, drift_per_step: float = 0.0, name: str = "device") -> None:
        self.counter = ClockedEnergyCounter(clock, name=name)
        self.watts_by_mode = dict(watts_by_mode)
        self.step_s_by_mode = dict(step_s_by_mode or {})
        self.noise, self.drift_per_step = noise, drift_per_step
        self._random = random.Random(seed)
        self.steps: list[tuple[str, float]] = []  # (mode, fake seconds) of every batch

    def seconds(self, mode: str) -> float:
        z = max(-3.0, min(3.0, self._random.gauss(0.0, 1.0)))
        drift = 1.0 + self.drift_per_step * len(self.steps)
        return self.step_s_by_mode.get(mode, STEP_SLEEP_S) * (1.0 + self.noise * z) * drift

    def run(self, mode: str, seconds: float) -> None:
        """Draw the mode's power for ``seconds`` of fake time."""
        self.counter.run(self.watts_by_mode[mode], seconds)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        mode = trainer.precision_plugin.mode_name
        seconds = self.seconds(mode)
        self.steps.append((mode, seconds))
        self.run(mode, seconds)
